"""The decoder layer's op order is written once (issue 54): in ``model/decoder_layer.py``.

A backend supplies ops (``attention_backend.StepOps``) and never a layer of its own, so no other
module of pagedkv reaches for the layer's parts by name: a second file that names ``o_proj`` or
``down_proj`` is a second statement of the order, which a family change (Qwen3's q/k norms, an
MLA projection, a row-parallel all-reduce) would have to find and repeat. Read from the source
with ``ast`` (attribute accesses; the loader's tables name weights in strings, not parts)."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedkv

SRC = Path(pagedkv.__file__).parent
THE_LAYER = SRC / "model" / "decoder_layer.py"
# The parts whose order is the layer's: its norms, projections and MLP halves; MLA's
# projections, norms and per-head weights (issue 55); the experts and their router.
SWIGLU_PARTS = {"gate_up_proj", "down_proj"}
MLA_PARTS = {"q_kv_a_proj", "q_a_norm", "q_b_proj", "kv_a_norm", "kv_b"}
MOE_PARTS = {"router_weight", "router_bias", "experts_gate_up", "experts_down", "shared"}
PARTS = {
    "input_norm", "post_attention_norm", "q_norm", "k_norm", "qkv_proj", "o_proj",
    *SWIGLU_PARTS, *MLA_PARTS, *MOE_PARTS,
}  # fmt: skip
# A module that owns a part's own behaviour may name that part's pieces and nothing else: the
# SwiGLU module its two projections, MLA's attention part its projections (its own order up
# to the layer's output projection), the experts their router and stacks (and the shared
# experts' SwiGLU, which they call).
OWNERS = {
    "model/layers.py": SWIGLU_PARTS,
    "model/mla/attention.py": MLA_PARTS,
    "model/moe.py": MOE_PARTS,
}


def parts_named(path: Path, allowed: frozenset[str] = frozenset()) -> list[str]:
    """``line: .attr`` for every access to a layer part in ``path`` (but ``allowed`` ones)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in PARTS - allowed
    ]


def test_no_module_but_the_layer_names_its_parts():
    named = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if path != THE_LAYER and (found := parts_named(path, frozenset(OWNERS.get(rel, ())))):
            named[rel] = found
    assert not named, f"a second statement of the layer's op order: {named}"


def test_the_owners_name_their_own_parts_only():
    """Each owner names its parts (the table is not stale) and no other layer part."""
    for rel, own in OWNERS.items():
        path = SRC / rel
        assert {found.rsplit(".", 1)[1] for found in parts_named(path)} <= own, rel
        assert parts_named(path) and not parts_named(path, frozenset(own)), rel


def test_the_check_sees_a_second_statement(tmp_path):
    """The old Triton backend's fused layer, as it was: caught."""
    old = tmp_path / "old_backend.py"
    old.write_text(
        "def run_layer(self, layer, hidden, x):\n    return layer.o_proj.added_to(hidden, x)\n"
    )
    assert parts_named(old) == ["2: .o_proj"]
    assert parts_named(THE_LAYER)  # the one layer does name them
