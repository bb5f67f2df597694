"""What each of pagedkv's own attention backends accepts, and why: the declarations the engine's
backends carry (``model/attention_backend.py``) and the planner's ``--backend`` rules read
(``planner/constraints.py``), one copy. Torch-free.

A rule answers, for a block size and a head dim, the reasons it refuses them (none: accepted),
and says in a note why it accepts what it does. All three of pagedkv's backends read K/V
through the block table one token (or one tile of tokens) at a time, so none constrains the
block size: the page is a storage unit, not a compute unit, on every path. Only the Triton
kernels constrain the head dim (a ``tl.arange`` extent: ``triton_rules.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.pages import triton_rules


def any_block_size(block_size: int, head_dim: int | None = None) -> list[str]:
    """Every block size >= 1 and every head dim."""
    return [] if block_size >= 1 else [f"block size {block_size} is not a positive size"]


@dataclass(frozen=True)
class BackendRule:
    """One backend's contract on the page. ``problems(block_size, head_dim or None)``: why it
    refuses them, in its own words (empty: accepted); ``layouts``: the attention kinds it
    reads; ``loops_over_tiles``: its loop count is tiles of the context, not blocks (the
    planner's time ledger says so instead of counting ceil(L / B))."""

    name: str
    note: str
    layouts: tuple[str, ...] = ("mha",)
    problems: Callable[[int, int | None], list[str]] = any_block_size
    loops_over_tiles: bool = False


TORCH_SDPA = BackendRule(
    "torch-sdpa",
    "pagedkv paged attention in torch (K/V gathered by slot, then SDPA; any device): any B >= 1",
    layouts=("mha", "mla"),
)
NATIVE = BackendRule(
    "native",
    "pagedkv's C kernels (CPU): keys and values read through the block table in runs of 32 "
    "positions, whatever the block: any B >= 1",
    loops_over_tiles=True,
)
TRITON = BackendRule(
    "triton",
    f"pagedkv's Triton kernels (GPU): {triton_rules.block_size_note()}",
    problems=triton_rules.block_size_problems,
    loops_over_tiles=True,
)
RULES = {rule.name: rule for rule in (TORCH_SDPA, NATIVE, TRITON)}
