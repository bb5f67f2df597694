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
# The parts whose order is the layer's: its norms, projections and MLP halves.
PARTS = {
    "input_norm", "post_attention_norm", "q_norm", "k_norm", "qkv_proj", "o_proj",
    "gate_up_proj", "down_proj",
}  # fmt: skip


def parts_named(path: Path) -> list[str]:
    """``line: .attr`` for every access to a layer part in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in PARTS
    ]


def test_no_module_but_the_layer_names_its_parts():
    named = {
        str(path.relative_to(SRC)): found
        for path in sorted(SRC.rglob("*.py"))
        if path != THE_LAYER and (found := parts_named(path))
    }
    # The modules that own a part's own behaviour (the SwiGLU module's halves) are not the
    # layer's order: SwiGLU holds its two projections.
    named.pop("model/layers.py", None)
    assert not named, f"a second statement of the layer's op order: {named}"


def test_the_check_sees_a_second_statement(tmp_path):
    """The old Triton backend's fused layer, as it was: caught."""
    old = tmp_path / "old_backend.py"
    old.write_text(
        "def run_layer(self, layer, hidden, x):\n    return layer.o_proj.added_to(hidden, x)\n"
    )
    assert parts_named(old) == ["2: .o_proj"]
    assert parts_named(THE_LAYER)  # the one layer does name them
