"""``TierChain``: the allocator's side of the lower tiers (see ``contract.py`` for the contract).

It continues a hash chain where the device index stops, remembers which tier supplies which
block between ``match_prefix`` and the admission right after it, turns the pool's evictions
into offload orders, lists write-through saves, counts hits per tier, and hands the step's
orders out once per step (``drain``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.protocol import KVCacheStats
from pagedkv.kvcache.tiers.contract import TIER_DEVICE, BlockLoad, KVTier, TierOrders

log = logging.getLogger("pagedkv.kvcache")

# (sequence id, number of tokens, first block the tiers supply, [(tier, number of blocks)])
_Plan = tuple[int, int, int, list[tuple[KVTier, int]]]


class TierChain:
    """Lower tiers in lookup order (host first, then a store). Mutated by the allocator only."""

    def __init__(self, tiers: Sequence[KVTier]) -> None:
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names) or TIER_DEVICE in names:
            raise ValueError(f"tiers need distinct names other than {TIER_DEVICE!r}: {names}")
        self.tiers = tuple(tiers)
        self._offload_tier = next((t for t in tiers if t.accepts_offloads), None)
        self.wants_saves = any(t.wants_saves for t in tiers)
        self.hit_blocks: dict[str, int] = dict.fromkeys(names, 0)  # admitted from each tier
        self._plan: _Plan | None = None
        self._offloads: list[tuple[int, BlockHash]] = []
        self._loads: list[BlockLoad] = []
        self._saves: list[tuple[int, BlockHash]] = []
        self._failed: set[str] = set()  # tiers whose match raised (logged once each)

    def enable_events(self, log: KVEventLog, block_size: int) -> None:
        """Tiers that keep their own blocks (the host tier) report them to ``log`` too; a
        shared store is no replica's cache and reports nothing."""
        for tier in self.tiers:
            if tier.event_medium is not None:
                tier.enable_events(log, block_size)

    def match(self, seq_id: int, num_tokens: int, first: int, rest: Sequence[BlockHash]) -> int:
        """Blocks of ``rest`` (the chain from block ``first`` on, where the device stopped)
        that the tiers supply, each tier continuing where the previous one stopped. The plan
        is kept for the admission of the same sequence right after."""
        plan: list[tuple[KVTier, int]] = []
        done = 0
        for tier in self.tiers:
            if done == len(rest):
                break
            n = self._match_one(tier, rest[done:])
            if n:
                plan.append((tier, n))
                done += n
        self._plan = (seq_id, num_tokens, first, plan)
        return done

    def _match_one(self, tier: KVTier, hashes: Sequence[BlockHash]) -> int:
        """``tier.match``, where an exception (a tier breaking its never-raise contract) is a
        miss, logged once per tier: the blocks are recomputed and the engine goes on."""
        try:
            return max(0, min(int(tier.match(hashes)), len(hashes)))
        except Exception as exc:  # noqa: BLE001 - any tier failure is a miss, by contract
            if tier.name not in self._failed:
                self._failed.add(tier.name)
                log.error("KV tier %s failed a match (%r); counted as misses", tier.name, exc)
            return 0

    def claim(
        self, seq_id: int, num_tokens: int, first: int, hashes: Sequence[BlockHash]
    ) -> list[str]:
        """Claim blocks ``first ..`` (``hashes``) from the tiers the last ``match`` for this
        sequence planned; returns the supplying tier's name per block. ValueError if no such
        match came right before (nothing is claimed then)."""
        plan = self._plan
        planned = sum(n for _, n in plan[3]) if plan else 0
        if plan is None or plan[:3] != (seq_id, num_tokens, first) or len(hashes) > planned:
            raise ValueError(
                f"sequence {seq_id}: {len(hashes)} blocks from the lower tiers were not matched "
                "right before this admission; call match_prefix again right before allocate"
            )
        self._plan = None
        names: list[str] = []
        for tier, n in plan[3]:
            take = min(n, len(hashes) - len(names))
            if take <= 0:
                break
            tier.claim(hashes[len(names) : len(names) + take])
            self.hit_blocks[tier.name] += take
            names.extend([tier.name] * take)
        return names

    def order_loads(
        self, tier_names: Sequence[str], hashes: Sequence[BlockHash], device_blocks: Sequence[int]
    ) -> None:
        """Order the loads of claimed blocks into their fresh ``device_blocks``."""
        self._loads.extend(map(BlockLoad, tier_names, hashes, device_blocks))

    def forget_plan(self) -> None:
        self._plan = None

    def evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """The pool hands out ``block_id`` that cached ``block_hash`` (the ``BlockPool``
        eviction hook): offer it to the offload tier."""
        tier = self._offload_tier
        if tier is not None and tier.offer(block_hash):
            self._offloads.append((block_id, block_hash))

    def computed(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Full blocks this step computes (write-through saves, when a tier wants them)."""
        if self.wants_saves:
            self._saves.extend(zip(block_ids, block_hashes, strict=True))

    def with_hits(self, stats: KVCacheStats, block_size: int) -> KVCacheStats:
        """``stats`` with its prefix hits split by tier (the device's are the rest)."""
        lower = [(name, n * block_size) for name, n in self.hit_blocks.items()]
        device = stats.prefix_hit_tokens - sum(n for _, n in lower)
        return replace(stats, tier_hit_tokens=((TIER_DEVICE, device), *lower))

    def drain(self) -> TierOrders:
        """The step's orders, handed out once; ends the step in every tier."""
        orders = TierOrders(tuple(self._offloads), tuple(self._loads), tuple(self._saves))
        self._offloads.clear()
        self._loads.clear()
        self._saves.clear()
        self._plan = None
        for tier in self.tiers:
            tier.end_step()
        return orders
