"""A model of the engine's KV memory for scheduler tests: what each device and host slot holds.

A slot holds the identity of the KV written there: the tokens of the sequence up to and
including that position (a token's K and V depend on its whole prefix). ``KVMemory.run``
applies a batch as the engine must (swap_out, swap_in, block_copies, then the forward pass)
and asserts that every sequence reads exactly its own tokens' KV as context: the check that
the copies the scheduler orders move the right tokens to the right sequences.
"""

from __future__ import annotations

from pagedkv.sched import ScheduledBatch, Scheduler

Content = tuple[int, ...] | None  # the prefix whose last token's KV a slot holds


class KVMemory:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.block_size = sched.allocator.block_size
        self.device: dict[int, list[Content]] = {}
        self.host: dict[int, list[Content]] = {}

    def _block(self, pool: dict[int, list[Content]], block: int) -> list[Content]:
        return pool.setdefault(block, [None] * self.block_size)

    def run(self, batch: ScheduledBatch) -> None:
        """Apply ``batch``'s copies in the documented order, check every scheduled sequence's
        context, then write the KV of its new tokens."""
        # Copies read their sources before any of them writes (as one gather/scatter would).
        outs = [(h, list(self._block(self.device, d))) for d, h in batch.swap_out]
        for h, data in outs:
            self.host[h] = data
        ins = [(d, list(self._block(self.host, h))) for h, d in batch.swap_in]
        for d, data in ins:
            self.device[d] = data
        cows = [(d, list(self._block(self.device, s))) for s, d in batch.block_copies]
        for d, data in cows:
            self.device[d] = data
        alloc, bs = self.sched.allocator, self.block_size
        writes = []
        for item in batch.seqs:  # every context is read before any new KV is written
            seq, start, n = item.seq, item.num_computed_tokens, item.num_new_tokens
            tokens = tuple(seq.token_ids)
            slots = alloc.slot_mapping(seq, 0, start + n)
            for pos in range(start):
                block, off = divmod(slots[pos], bs)
                got = self._block(self.device, block)[off]
                assert got == tokens[: pos + 1], (
                    f"step {batch.step}: {seq} reads wrong KV at position {pos}"
                )
            writes.append((tokens, slots, start, n))
        for tokens, slots, start, n in writes:
            for pos in range(start, start + n):
                block, off = divmod(slots[pos], bs)
                self._block(self.device, block)[off] = tokens[: pos + 1]
