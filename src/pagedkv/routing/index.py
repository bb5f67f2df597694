"""``PrefixIndex``: which replica's prefix cache holds which chained block hash.

Fed by each replica's KV events (``kvcache/events.py``) and read by the prefix-aware policy: for
a request's block hashes it answers, per replica, how many leading blocks that replica holds.
A block counts for a replica when any of its media (device, host) holds it. The index is a
hint, not a lock: events arrive a step (or a network hop) late, so a replica may have evicted
a block the index still lists; the cost of a wrong hint is one recomputed prefix, never a
wrong answer (the replica matches on its own cache).

Memory is bounded: at most ``max_entries`` (hash, replica) entries, whatever the replicas (or
anyone writing to their event streams) report. Past it, the replica holding the most entries
loses its least recently stored ones (``num_evicted``, per replica in ``evicted``). Chosen over
a fixed quota per replica because replicas' caches differ (a host tier holds far more than a
GPU) and a quota would leave the bound unused; and over one global LRU because that would let
one replica's flood push out every other replica's view. With the largest-first rule a replica
holding at most ``max_entries / num_replicas`` entries is never evicted from: while the total
is over the bound, the largest holds more than that share. An evicted entry is a missed hint,
never a wrong answer.

**Partial blocks.** A replica that reuses partial blocks (``kvcache/partial.py``) sends the
stored blocks' ``token_ids``; the index then keeps, per replica, the same per-parent token
index the allocator keeps (``SiblingIndex``), and ``match_tokens`` scores a request in tokens:
its leading whole blocks, plus the tokens of the next block that a block the replica holds
after them starts with. Block 0's parent is the tenant's root, which events do not name (the
salt is the replica's secret): the index keys it by LoRA id alone, so requests of different
salts may be scored on each other's first block, a wrong hint at worst. An entry with tokens
costs their 4 bytes each more; the ``max_entries`` bound still counts entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagedkv.kvcache.events import MEDIUM_DEVICE, BlockRemoved, BlockStored, KVEvent
from pagedkv.kvcache.hashing import (
    DEFAULT_HASH_ALGORITHM,
    NO_EXTRA_KEYS,
    BlockHash,
    HashExtraKeys,
    get_hash_fn,
    hash_blocks,
    root_hash,
    token_bytes,
)
from pagedkv.kvcache.sibling_index import SiblingIndex


def _root_key(lora_id: str | None) -> BlockHash:
    """Block 0's parent in the token index: the LoRA id (events do not name the salt)."""
    return b"root\x00" + (lora_id or "").encode()


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


DEFAULT_MAX_ENTRIES = 1 << 20  # (hash, replica) entries: ~1M, ~0.2 GiB (measured: docs/routing.md)
_MAX_INTERNED_MEDIA = 64  # distinct media sets shared between entries (past it: not shared)


class PrefixIndex:
    """Replica name -> the hashes its prefix cache holds, and hash -> the replicas holding it.

    ``apply`` events of one replica in the order it emitted them. Mutated only by ``apply`` and
    ``drop_replica``; not thread-safe (the router applies events under the feed's lock)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        # replica -> hash -> the media holding it there; least recently stored first
        self._held: dict[str, OrderedDict[BlockHash, frozenset[str]]] = {}
        # hash -> the replica holding it, or the set of them when several do (one name, not a
        # set, for the common unshared hash: a set would double an entry's bytes)
        self._holders: dict[BlockHash, str | set[str]] = {}
        self._media: dict[frozenset[str], frozenset[str]] = {}
        self.num_entries = 0
        self.num_events = 0
        self.num_evicted = 0
        self.evicted: dict[str, int] = {}  # replica -> entries evicted from it (monotonic)
        # replica -> its device blocks' tokens by parent, when its events carry them
        self._siblings: dict[str, SiblingIndex] = {}

    def replicas(self) -> list[str]:
        return list(self._held)

    def num_blocks(self, replica: str) -> int:
        """Distinct hashes ``replica`` holds (over all media)."""
        return len(self._held.get(replica, ()))

    def holds(self, replica: str) -> set[BlockHash]:
        """Every hash ``replica`` holds, over all media (a fresh set)."""
        return set(self._held.get(replica, ()))

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        for ev in events:
            self.num_events += 1
            if isinstance(ev, BlockStored):
                if ev.token_ids is not None and ev.medium == MEDIUM_DEVICE:
                    self._index_tokens(replica, ev)
                for h in ev.block_hashes:
                    media = held.get(h)
                    if media is None:
                        held[h] = self._interned(frozenset((ev.medium,)))
                        self._hold(h, replica)
                        self.num_entries += 1
                        if self.num_entries > self.max_entries:
                            self._evict()
                    else:
                        if ev.medium not in media:
                            held[h] = self._interned(media | {ev.medium})
                        held.move_to_end(h)  # stored again: recently updated
            elif isinstance(ev, BlockRemoved):
                siblings = self._siblings.get(replica) if ev.medium == MEDIUM_DEVICE else None
                for h in ev.block_hashes:
                    if siblings is not None:
                        siblings.remove(h)
                    media = held.get(h)
                    if media is None or ev.medium not in media:
                        continue  # unknown (or evicted) here: nothing to forget
                    if len(media) > 1:
                        held[h] = self._interned(media - {ev.medium})
                    else:
                        del held[h]
                        self._unhold(h, replica)
                        self.num_entries -= 1
            else:  # AllBlocksCleared
                self._clear(replica)

    def drop_replica(self, replica: str) -> None:
        """Forget ``replica`` (dead, restarted or removed)."""
        self._clear(replica)
        self._held.pop(replica, None)

    def _index_tokens(self, replica: str, ev: BlockStored) -> None:
        """The run's blocks by parent, with their tokens (``block_size`` each, a kept tail's
        fewer)."""
        siblings = self._siblings.setdefault(replica, SiblingIndex())
        parent = ev.parent_block_hash or _root_key(ev.lora_id)
        tokens, bs = ev.token_ids or (), ev.block_size
        for k, h in enumerate(ev.block_hashes):
            siblings.add(parent, h, token_bytes(tokens[k * bs : (k + 1) * bs]))
            parent = h

    def match_tokens(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        block_size: int,
        lora_id: str | None = None,
    ) -> dict[str, int]:
        """Replica -> how many leading tokens of the prompt ``token_ids`` (whose block hashes
        are ``block_hashes``) it holds: ``match``'s whole blocks, plus what a replica sending
        token ids holds of the next block (never the last token, which is always computed).
        Mutates nothing."""
        blocks = self.match(block_hashes)
        out = {r: n * block_size for r, n in blocks.items()}
        limit = len(token_ids) - 1
        for replica, siblings in self._siblings.items():
            n = blocks.get(replica, 0)
            start = n * block_size
            if start >= limit or n > len(block_hashes):
                continue
            parent = block_hashes[n - 1] if n else _root_key(lora_id)
            query = token_bytes(token_ids[start : min(start + block_size, limit)])
            best = max((shared for shared, _ in siblings.candidates(parent, query)), default=0)
            if best:
                out[replica] = start + best
        return out

    def _clear(self, replica: str) -> None:
        self._siblings.pop(replica, None)
        held = self._held.get(replica)
        if held:
            for h in held:
                self._unhold(h, replica)
            self.num_entries -= len(held)
            held.clear()

    def _hold(self, h: BlockHash, replica: str) -> None:
        per = self._holders.get(h)
        if per is None:
            self._holders[h] = replica
        elif isinstance(per, str):
            self._holders[h] = {per, replica}
        else:
            per.add(replica)

    def _unhold(self, h: BlockHash, replica: str) -> None:
        per = self._holders[h]
        if isinstance(per, str):
            del self._holders[h]
            return
        per.discard(replica)
        if len(per) == 1:
            (self._holders[h],) = per

    def _evict(self) -> None:
        """Drop the least recently stored entry of the replica holding the most."""
        victim = max(self._held, key=lambda r: len(self._held[r]))
        h, _ = self._held[victim].popitem(last=False)
        self._unhold(h, victim)
        if victim in self._siblings:
            self._siblings[victim].remove(h)
        self.num_entries -= 1
        self.num_evicted += 1
        self.evicted[victim] = self.evicted.get(victim, 0) + 1

    def _interned(self, media: frozenset[str]) -> frozenset[str]:
        """One shared object per set of media (an entry's value), for the first few sets."""
        if len(self._media) < _MAX_INTERNED_MEDIA:
            return self._media.setdefault(media, media)
        return self._media.get(media, media)

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
                alive_now = {per} if isinstance(per, str) else set(per)
            elif isinstance(per, str):
                alive_now = {per} if per in alive else set()
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
