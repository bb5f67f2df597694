"""Lower KV tiers: where a full block can live besides the device pool, and the step's orders.

The device pool (``BlockPool``) is tier 0. Below it an allocator may have lower tiers, in
order (the host tier, then a shared store). Every tier speaks the same key: the chained block
hash (``hashing.py``), which already covers the tokens before the block, the ``cache_salt``, the
LoRA id and the multimodal spans, so a lower tier isolates tenants exactly as the device does.

How the allocator (``PagedAllocator`` with a ``TierChain``) uses them:

* **Match.** ``match_prefix`` walks the hash chain in the device index as before; where the
  device chain breaks, it asks each lower tier in turn for the *next* blocks
  (``tier.match(rest)``: how many leading hashes of ``rest`` it can supply). The blocks a tier
  supplies count as computed tokens, exactly like a device prefix hit (``prefix_hit_tokens``,
  and so ``cached_tokens`` in the API's usage), and are counted per tier.
* **Load.** On admission the allocator ``claim``s those hashes from their tiers, gives each a
  fresh device block (registered under its hash at once, like any full block) and records a
  ``BlockLoad(tier, hash, device_block)`` order. The engine executes the step's loads before the
  forward pass; the scheduler only ever sees a longer prefix hit.
* **Offload.** When the device pool evicts a cached block (``BlockPool.take`` reuses it), the
  block's hash is ``offer``-ed to the first tier that ``accepts_offloads`` (the host tier). If
  the tier wants it, the allocator records ``(device_block, hash)``: the engine copies the block
  out FIRST in the step, because the same step hands the block to someone else and the forward
  pass (or a load) overwrites it.
* **Save** (write-through). For tiers that ``wants_saves`` (a shared store), every full block
  the step computes is listed as ``(device_block, hash)``; the engine copies it out AFTER the
  forward pass that fills it.

The step's orders (``TierOrders``) are drained into the ``ScheduledBatch`` at the end of
``Scheduler.schedule``; that drain is the step boundary: ``end_step`` is called on every tier.

Hazards the contract rules out (so the engine may execute each kind of order as one batched
gather/scatter per layer, in the order of ``sched/batch.py``):

* a tier never reports (``match``) a block offered to it in the same step: its bytes arrive
  only when the engine executes the step's offloads;
* a tier keeps every block claimed in a step readable until the engine has executed that
  step's loads: an offload in the same step must not overwrite it (a host index pins it);
* a device block read by an offload is a cached block at the start of the step; it is written
  (by a load, a swap-in or the forward) only after every offload of the step has read it.

Failures: a tier that cannot answer (a store down, a corrupt or foreign payload) reports a miss
from ``match`` and never raises; the block is then recomputed. A tier that must fetch bytes (a
store) fetches and verifies them in ``match`` and stages them, so the engine's load only copies
bytes that already passed the checksum and cannot fail in the middle of a step.

Pure Python (no torch): the simulator may run the same tiers' indexes without moving bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash

# The tier names the engine's stats and /metrics label hits with ("device" is the pool itself).
TIER_DEVICE = "device"
TIER_HOST = "host"
TIER_STORE = "store"


@runtime_checkable
class KVTier(Protocol):
    """One lower tier, as the allocator sees it: an index of block hashes it can supply.

    The object the allocator holds decides *what* is where; moving the bytes is the engine's
    part (``engine/kv/mover.py`` maps ``name`` to the torch-side executor).
    """

    @property
    def name(self) -> str:
        """The label of its hits, loads and metrics (``"host"``, ``"store"``); unique, never
        ``"device"``."""
        ...

    @property
    def accepts_offloads(self) -> bool:
        """Whether blocks evicted from the device are offered to it (the host tier: True)."""
        ...

    @property
    def wants_saves(self) -> bool:
        """Whether every full block a step computes is listed for it (write-through: a store)."""
        ...

    @property
    def event_medium(self) -> str | None:
        """The medium of the KV events this tier reports (``"host"`` for the host tier), or
        None for a tier that is no replica's own cache (a shared store): it reports none."""
        ...

    def enable_events(self, log: KVEventLog, block_size: int) -> None:
        """(Only called when ``event_medium`` is set.) Report every hash entering or leaving
        this tier to ``log``, starting with the ones held now."""
        ...

    def hashes(self) -> list[BlockHash]:
        """The hashes held now, what replaying this tier's events gives (empty for a tier
        without ``event_medium``). A fresh list; O(blocks): for snapshots and checks."""
        ...

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes of ``block_hashes`` (non-empty, consecutive blocks of one
        chain) this tier can supply now, 0..len. Never raises: an error is a miss. Changes
        nothing the allocator can observe (a store may fetch, verify and stage payloads; a host
        index does not even touch its LRU order)."""
        ...

    def claim(self, block_hashes: Sequence[BlockHash]) -> None:
        """The allocator loads these blocks (a prefix of what ``match`` just reported) in this
        step: keep them readable until the engine has executed this step's loads (count them as
        used: a host index makes them most recently used and pins them until ``end_step``)."""
        ...

    def offer(self, block_hash: BlockHash) -> bool:
        """(Only called when ``accepts_offloads``.) The device evicts a block holding
        ``block_hash``. True: the tier made room and the engine must copy the block in (an
        offload order; ``match`` may report it from the next step on). False: it already holds
        the hash (it may refresh its LRU position) or declines; no copy."""
        ...

    def end_step(self) -> None:
        """The step's orders were handed to the engine, which executes them before the next
        ``schedule``: drop per-step pins. A store keeps the payloads of claimed loads until
        its executor consumes them; unclaimed staged payloads may go."""
        ...


class PrefixCopy(NamedTuple):
    """Copy slots ``[0, num_tokens)`` of ``src_block`` into ``dst_block`` (every layer's K and
    V) before the forward pass of the step: the matched tokens of a partial prefix hit
    (``kvcache/partial.py``), ``0 < num_tokens < block_size``. ``src_block`` is a full block
    no one writes; ``dst_block`` a fresh block of the admitted sequence."""

    src_block: int
    dst_block: int
    num_tokens: int


class BlockLoad(NamedTuple):
    """Copy the block ``block_hash`` from tier ``tier`` into ``device_block`` (before the
    forward pass of the step)."""

    tier: str
    block_hash: BlockHash
    device_block: int


@dataclass(frozen=True)
class TierOrders:
    """The tier copies of one step, drained from the allocator by ``Scheduler.schedule``, and
    the device copies of its partial prefix hits (``prefix_copies``, empty unless the prefix
    match unit is below the block size).

    ``offloads`` and ``saves`` are ``(device_block, block_hash)`` pairs; each kind in the order
    it was decided. A caller may keep the tuples."""

    offloads: tuple[tuple[int, BlockHash], ...] = ()
    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[tuple[int, BlockHash], ...] = ()
    prefix_copies: tuple[PrefixCopy, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.offloads or self.loads or self.saves or self.prefix_copies)


NO_TIER_ORDERS = TierOrders()
