"""``TierCounts``: blocks and bytes the lower KV tiers moved (torch-free, for stats and metrics).

Hit tokens per tier are the allocator's fact (``KVCacheStats.tier_hit_tokens``); what was
copied, and how many bytes, is the engine's (``engine/kv/mover.py`` adds to this).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What a tier copy can be: device -> tier on eviction, tier -> device on a hit, and
# device -> tier write-through of a computed block.
KINDS = ("offloaded", "loaded", "saved")


@dataclass
class TierCounts:
    """Running totals, ``(tier, kind) -> blocks`` and ``-> bytes``. Mutated by the engine
    thread; ``copy`` gives a snapshot another thread may keep."""

    blocks: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, tier: str, kind: str, num_blocks: int, block_bytes: int) -> None:
        key = (tier, kind)
        self.blocks[key] = self.blocks.get(key, 0) + num_blocks
        self.bytes[key] = self.bytes.get(key, 0) + num_blocks * block_bytes

    def total_blocks(self, kind: str) -> int:
        return sum(n for (_, k), n in self.blocks.items() if k == kind)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def copy(self) -> TierCounts:
        return TierCounts(dict(self.blocks), dict(self.bytes))


def tier_rows(tier_hit_tokens: tuple[tuple[str, int], ...]) -> list[tuple[str, str]]:
    """The stats table's row of prefix-hit tokens per tier (none without lower tiers)."""
    if not tier_hit_tokens:
        return []
    return [("prefix-hit tokens by tier", ", ".join(f"{t} {n}" for t, n in tier_hit_tokens))]
