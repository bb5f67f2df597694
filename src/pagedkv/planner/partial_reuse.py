"""The planner's side of partial-block reuse (``kvcache/partial.py``): the prefix-match unit at
each candidate block size, and what a hit's copy costs against recomputing its tokens.

The ledger itself is ``ledgers.py``'s third (counted in units of U); here are the rule that
picks U per B and the time beside it, which W(B) does not count (a copy moves bytes, it wastes
none: the block it fills is the sequence's own).
"""

from __future__ import annotations

from pagedkv.errors import UsageError


def unit_at(block_size: int, prefix_match_unit: int | None) -> int:
    """The prefix-match unit at ``block_size``: U where it divides B, B where U >= B (whole
    blocks); UsageError naming ``--prefix-match-unit`` where U < B does not divide it."""
    unit = prefix_match_unit
    if unit is None or unit >= block_size:
        return block_size
    if unit < 1 or block_size % unit:
        raise UsageError(
            f"--prefix-match-unit: {unit} must divide every candidate block size above it, "
            f"not B={block_size}",
            "--prefix-match-unit",
        )
    return unit


def copy_reason(
    unit: int,
    copy_tokens: float,
    copy_bytes: float,
    copy_s: float | None = None,
    recompute_s: float | None = None,
) -> str:
    """The recommendation's line on partial-block reuse at the chosen B: the tokens a hit
    reuses out of a partially matched block and their copy, in time against recomputing them
    when both are priced."""
    text = (
        f"partial-block reuse (U={unit}): a hit reuses {copy_tokens:.1f} tokens of a partially "
        f"matched block on average ({copy_bytes / 1024:.1f} KiB copied, or none when the block "
        "is claimed in place)"
    )
    if copy_s is not None and recompute_s is not None:
        text += f": {copy_s * 1e6:.1f} us to copy vs {recompute_s * 1e6:.1f} us to recompute them"
    return text
