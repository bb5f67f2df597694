"""``PrefixIndex``: which replica's prefix cache holds which chained block hash.

Fed by each replica's KV events (``kvcache/events.py``) and read by the prefix-aware policy: for
a request's block hashes it answers, per replica, how many leading blocks that replica holds.
A block counts for a replica when any of its media (device, host) holds it. The index is a
hint, not a lock: events arrive a step (or a network hop) late, so a replica may have evicted
a block the index still lists; the cost of a wrong hint is one recomputed prefix, never a
wrong answer (the replica matches on its own cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedkv.kvcache.events import BlockRemoved, BlockStored, KVEvent
from pagedkv.kvcache.hashing import (
    DEFAULT_HASH_ALGORITHM,
    NO_EXTRA_KEYS,
    BlockHash,
    HashExtraKeys,
    get_hash_fn,
    hash_blocks,
    root_hash,
)


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: HashExtraKeys = NO_EXTRA_KEYS,
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM,
) -> list[BlockHash]:
    """The chained hashes of the prompt's blocks a replica could reuse: the full blocks before
    its last token (an engine always recomputes the last token), as ``PagedAllocator`` and
    ``RadixAllocator`` (one block per page) hash them."""
    fn = get_hash_fn(hash_algorithm)
    num_blocks = max(len(token_ids) - 1, 0) // block_size
    return hash_blocks(
        token_ids, block_size, root_hash(extra, fn), num_blocks=num_blocks, extra=extra, hash_fn=fn
    )


class PrefixIndex:
    """Replica name -> the hashes its prefix cache holds, and hash -> the replicas holding it.

    ``apply`` events of one replica in the order it emitted them. Mutated only by ``apply`` and
    ``drop_replica``; not thread-safe (the router applies events on its event loop)."""

    def __init__(self) -> None:
        # replica -> medium -> hashes held there
        self._held: dict[str, dict[str, set[BlockHash]]] = {}
        # hash -> replica -> number of media of that replica holding it (>= 1)
        self._holders: dict[BlockHash, dict[str, int]] = {}
        self.num_events = 0

    def replicas(self) -> list[str]:
        return list(self._held)

    def num_blocks(self, replica: str) -> int:
        """Distinct hashes ``replica`` holds (over all media)."""
        return len(self.holds(replica))

    def holds(self, replica: str) -> set[BlockHash]:
        """Every hash ``replica`` holds, over all media (a fresh set)."""
        return set().union(*self._held.get(replica, {}).values())

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        media = self._held.setdefault(replica, {})
        holders = self._holders
        for ev in events:
            self.num_events += 1
            if isinstance(ev, BlockStored):
                held = media.setdefault(ev.medium, set())
                for h in ev.block_hashes:
                    if h not in held:
                        held.add(h)
                        per = holders.setdefault(h, {})
                        per[replica] = per.get(replica, 0) + 1
            elif isinstance(ev, BlockRemoved):
                medium = media.get(ev.medium)  # None: nothing of that medium held yet
                if medium:
                    for h in ev.block_hashes:
                        if h in medium:
                            medium.discard(h)
                            self._unhold(h, replica)
            else:  # AllBlocksCleared
                self._clear(replica)

    def drop_replica(self, replica: str) -> None:
        """Forget ``replica`` (dead, restarted or removed)."""
        self._clear(replica)
        self._held.pop(replica, None)

    def _clear(self, replica: str) -> None:
        for held in self._held.get(replica, {}).values():
            for h in held:
                self._unhold(h, replica)
            held.clear()

    def _unhold(self, h: BlockHash, replica: str) -> None:
        per = self._holders[h]
        n = per[replica] - 1
        if n:
            per[replica] = n
        else:
            del per[replica]
            if not per:
                del self._holders[h]

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Replica -> how many leading blocks of ``block_hashes`` it holds (replicas holding
        none are absent). Mutates nothing; O(blocks matched x replicas holding them)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        holders = self._holders
        for i, h in enumerate(block_hashes):
            per = holders.get(h)
            if per is None:
                alive_now: set[str] = set()
            elif alive is None:
                alive_now = set(per)
            else:
                alive_now = alive.intersection(per)
            if alive is not None:
                for r in alive - alive_now:
                    out[r] = i
            alive = alive_now
            if not alive:
                return out
        for r in alive or ():
            out[r] = len(block_hashes)
        return out
