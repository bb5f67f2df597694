"""The host swap space: whole KV blocks parked in host memory while their sequence is preempted.

``SwapSpace`` hands out host block ids ``0 .. num_blocks - 1`` (so the engine can index a host
tensor pool of the same block layout directly) and remembers which sequence owns each one.
``swap_out`` and ``swap_in`` move a sequence between an allocator and the swap space using only
the ``KVAllocator`` protocol, so every allocator (paged, radix, reserved) can swap; they return
the whole-block copies the engine must apply, and change nothing when they return None.

The copies are orders, not actions: the device blocks of a swap-out are freed at once (a later
allocation in the same step may reuse them), so the engine must apply every ``swap_out`` copy of
a step before anything writes device blocks (see ``sched.batch.ScheduledBatch``).
"""

from __future__ import annotations

from pagedkv.kvcache.allocator_base import ceil_div
from pagedkv.kvcache.protocol import KVAllocator, SeqLike


class SwapSpace:
    """A pool of ``num_blocks`` host blocks, each owned by at most one sequence."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a swap space needs num_blocks >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Popped from the end: the lowest ids go first, which keeps small tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[int, list[int]] = {}  # seq id -> its host blocks, in logical order

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._owned

    def blocks_of(self, seq_id: int) -> list[int]:
        """The host blocks of ``seq_id`` in logical order (a copy); ValueError if it has none."""
        try:
            return list(self._owned[seq_id])
        except KeyError:
            raise ValueError(f"sequence {seq_id} holds no blocks in the swap space") from None

    def take(self, seq_id: int, num_blocks: int) -> list[int] | None:
        """``num_blocks`` host blocks for ``seq_id``, or None (nothing changes) if fewer are
        free. ValueError if the sequence already holds host blocks."""
        if seq_id in self._owned:
            raise ValueError(f"sequence {seq_id} is already swapped out")
        if num_blocks > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(num_blocks)]
        self._owned[seq_id] = ids
        return list(ids)

    def release(self, seq_id: int) -> list[int]:
        """Give back every host block of ``seq_id``; returns them. ValueError if none."""
        ids = self.blocks_of(seq_id)
        del self._owned[seq_id]
        self._free.extend(reversed(ids))
        return ids

    def check_invariants(self) -> None:
        """Every host block is either free or owned by exactly one sequence, never both."""
        owned = [b for ids in self._owned.values() for b in ids]
        every = owned + self._free
        assert len(every) == self.num_blocks, "host blocks leaked or counted twice"
        assert sorted(every) == list(range(self.num_blocks)), "a host block is doubly owned"


def swap_out(
    alloc: KVAllocator, space: SwapSpace, seq: SeqLike, num_tokens: int
) -> list[tuple[int, int]] | None:
    """Park the first ``num_tokens`` tokens of ``seq`` (its computed ones) in ``space`` and free
    its device blocks (``free(preempted=True)``: full ones stay in the prefix cache).

    Returns the ``(device_block, host_block)`` copies, one per block holding those tokens, or
    None, changing nothing, when the swap space cannot hold all of them (then the caller falls
    back to recompute). ValueError if ``seq`` holds fewer than ``num_tokens`` slots."""
    have = alloc.num_tokens(seq)
    if num_tokens > have:
        raise ValueError(f"swap_out: sequence {seq.seq_id} holds {have} tokens, not {num_tokens}")
    # Read the table before freeing: a radix free may switch it to the tree's duplicate pages,
    # but these blocks hold the tokens now and nothing writes them before the copy.
    device = list(alloc.block_table(seq)[: ceil_div(num_tokens, alloc.block_size)])
    host = space.take(seq.seq_id, len(device))
    if host is None:
        return None
    alloc.free(seq, preempted=True)
    return list(zip(device, host, strict=True))


def swap_in(
    alloc: KVAllocator, space: SwapSpace, seq: SeqLike, num_tokens: int, max_new_tokens: int
) -> tuple[int, int, list[tuple[int, int]]] | None:
    """Bring ``seq`` back: admit it with slots for its ``num_tokens`` swapped tokens plus up to
    ``max_new_tokens`` (>= 1) of what it computes next, reusing whatever prefix the cache still
    holds (counted as a prefix query, as a recompute's admission would be).

    Returns ``(start, num_new, copies)``: ``start`` = max(prefix hit, ``num_tokens``) is where
    its computation resumes, ``num_new`` how many tokens got slots after it, ``copies`` the
    ``(host_block, device_block)`` pairs for the swapped blocks the cache does not cover. Its
    host blocks are released. None (nothing changes, the blocks stay in the swap space) when
    the allocator has no room."""
    host = space.blocks_of(seq.seq_id)
    hit = alloc.match_prefix(seq)
    # Whole blocks only: the host holds the block a partial hit would copy into, whole.
    hit -= hit % alloc.block_size
    start = max(hit, num_tokens)
    num_new = min(len(seq.token_ids) - start, max_new_tokens)
    if num_new < 1:
        raise ValueError(f"swap_in: sequence {seq.seq_id} has no token left to compute")
    if not alloc.allocate(seq, start + num_new - hit, num_cached_tokens=hit):
        return None
    space.release(seq.seq_id)
    table = alloc.block_table(seq)
    # Blocks wholly inside the hit come from the cache, the rest from the host (a hit is a
    # whole number of blocks, so no block is both; a hit beyond the swapped tokens needs none).
    copies = [(host[i], table[i]) for i in range(hit // alloc.block_size, len(host))]
    return start, num_new, copies
