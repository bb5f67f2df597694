"""``HostTierIndex``: which cached prefix blocks the host tier holds, and where (pure Python).

The host tier keeps blocks the device evicted, keyed by the same chained block hash, in a host
pool of ``num_blocks`` slots in the device pool's block layout (the engine owns the tensors:
``engine/kv/host_tier.py``). This index owns the facts: which hash sits in which host slot, the
LRU order, and the per-step pins of the ``KVTier`` contract (``tiers/contract.py``):

* a hash offered (offloaded) in a step is pinned and *pending*: not matched before the engine
  has executed the step's offloads, and its slot not reused by another offer of the step;
* a hash claimed (loaded) in a step is pinned: no offer of the same step reuses its slot.

When every slot is full, an offer takes the least recently used unpinned slot; when every
slot is pinned, the offer is declined (the block is simply dropped, as without a host tier).
The tier is inclusive: a block loaded back to the device stays here too, so its later device
eviction costs no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pagedkv.kvcache.events import MEDIUM_HOST, KVEventLog
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.tiers.contract import TIER_HOST


class HostTierIndex:
    """An LRU index of ``num_blocks`` host slots; satisfies ``KVTier`` (name ``"host"``)."""

    name = TIER_HOST
    accepts_offloads = True
    wants_saves = False
    event_medium = MEDIUM_HOST

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a host tier needs num_blocks >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        self._pinned: set[BlockHash] = set()
        self._pending: set[BlockHash] = set()
        self.num_offloaded = 0  # offers accepted (blocks the engine copied in)
        self.num_dropped = 0  # blocks pushed out by the LRU to make room
        self.num_declined = 0  # offers refused because every slot was pinned
        self._events: KVEventLog | None = None
        self._block_size = 0

    def enable_events(self, log: KVEventLog, block_size: int) -> None:
        """Report hashes entering and leaving this tier to ``log`` (medium ``host``), starting
        with the ones held now. Parents are not known here: ``parent_block_hash`` is None."""
        self._events, self._block_size = log, block_size
        for h in self._slots:
            log.stored([h], None, block_size, medium=MEDIUM_HOST)

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def slot_of(self, block_hash: BlockHash) -> int:
        """The host slot holding ``block_hash``; KeyError if it is not here."""
        return self._slots[block_hash]

    def hashes(self) -> list[BlockHash]:
        """Every held hash, least recently used first (a copy; for tests and debugging)."""
        return list(self._slots)

    # -- the KVTier contract ---------------------------------------------------------------

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        slots, pending = self._slots, self._pending
        n = 0
        for h in block_hashes:
            if h not in slots or h in pending:
                break
            n += 1
        return n

    def claim(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            self._slots.move_to_end(h)  # KeyError: not matched right before (a caller bug)
            self._pinned.add(h)

    def offer(self, block_hash: BlockHash) -> bool:
        slots = self._slots
        if block_hash in slots:
            slots.move_to_end(block_hash)
            return False
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h in slots if h not in self._pinned), None)
            if victim is None:
                self.num_declined += 1
                return False
            slot = slots.pop(victim)
            self.num_dropped += 1
            if self._events is not None:
                self._events.removed(victim, MEDIUM_HOST)
        slots[block_hash] = slot
        if self._events is not None:
            self._events.stored([block_hash], None, self._block_size, medium=MEDIUM_HOST)
        self._pinned.add(block_hash)
        self._pending.add(block_hash)
        self.num_offloaded += 1
        return True

    def end_step(self) -> None:
        self._pinned.clear()
        self._pending.clear()

    # -- maintenance -----------------------------------------------------------------------

    def clear(self) -> int:
        """Forget every block (a cache reset); returns how many were held."""
        n = len(self._slots)
        if self._events is not None:
            for h in self._slots:
                self._events.removed(h, MEDIUM_HOST)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._slots.clear()
        self._pinned.clear()
        self._pending.clear()
        return n

    def check_invariants(self) -> None:
        """Every slot is free or holds exactly one hash; pins name held hashes."""
        held = list(self._slots.values())
        every = held + self._free
        assert sorted(every) == list(range(self.num_blocks)), "a host slot leaked or is doubled"
        assert self._pending <= self._pinned, "a pending offload is not pinned"
        assert self._pinned <= self._slots.keys(), "a pin names a hash the tier does not hold"
