"""``Scheduler``: continuous batching over any ``KVAllocator``, with recompute or swap preemption.

One engine step is ``batch = scheduler.schedule()``, the forward pass over ``batch.seqs``, then
``scheduler.update(batch, sampled)``. ``schedule`` serves running sequences first (a decode
token each, or the next chunk of an unfinished prompt), then admits waiting ones in arrival
order (prefix match, then a prompt chunk within the token budget). When the allocator refuses
to grow a running sequence, the victim policy picks a sequence to preempt: its blocks are freed
(full ones stay in the prefix cache) and it returns to the head of the waiting queue to be
recomputed; no new sequence is admitted in a step that preempted. A request that can never fit
(prompt + max_new_tokens beyond ``max_model_len`` or the whole pool) is refused when added.

With a swap space (``preemption_mode="swap"``) a victim whose computed blocks all fit in it is
swapped out instead: the batch orders ``(device, host)`` copies, its device blocks are freed and
it waits in the ``swapped`` queue with its progress kept. In a step that preempted nobody,
swapped sequences come back first, oldest first, into fresh device blocks (``(host, device)``
copies; blocks the prefix cache still holds are reused, not copied) and run that same step;
waiting sequences are admitted only once nobody is swapped out. A victim that does not fit the
swap space is recomputed (``num_swap_fallbacks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.kvcache.tiers.swap_space import swap_in, swap_out
from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq
from pagedkv.sched.recorder import StepRecorder
from pagedkv.sched.sequence import Seq, SequenceStatus

_RUNNING = SequenceStatus.RUNNING


@dataclass
class _StepDraft:
    """The step being planned: its entries so far, the token budget left, and its orders."""

    budget: int  # tokens the step may still compute
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Seq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def take(self, seq: Seq, start: int, num_new: int, prefix_hit_tokens: int = 0) -> None:
        """Schedule ``seq``'s tokens ``[start, start + num_new)``, paid from the budget."""
        num_samples = seq.samples_after(num_new)
        self.seqs.append(ScheduledSeq(seq, start, num_new, num_samples, prefix_hit_tokens))
        self.budget -= num_new


class Scheduler(StepRecorder):
    """Plans steps (``schedule``) and records them (``StepRecorder``: ``commit_ahead``,
    ``update``) over the queues of ``RequestQueues`` (same constructor)."""

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Plan one step (see the module docstring). Mutates the allocator (slots for every
        scheduled token are allocated here), the queues and the preempted sequences;
        ``num_computed_tokens`` advances only in ``update``."""
        self._step += 1
        draft = _StepDraft(budget=self.max_num_batched_tokens)
        self._serve_running(draft)
        # Nobody comes in after a preemption: a swap-in or an admission would only take back
        # the blocks just freed (and a step never swaps the same block out and in).
        if not draft.preempted:
            self._swap_back_in(draft)
            if not self.swapped:  # the swapped-out come before the waiting
                self._admit_waiting(draft)
        return self._close(draft)

    def _serve_running(self, draft: _StepDraft) -> None:
        """1. Running sequences, in order: a decode token, or the next chunk of a prompt, each
        allocated or else preempting until it fits (``_allocate_or_preempt``)."""
        running = self.running
        i = 0
        while i < len(running) and draft.budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            num_new = min(seq.num_tokens - start, draft.budget)
            if num_new == 0:  # its samples are still being drawn (``commit_ahead``): next step
                i += 1
                continue
            if self._allocate_or_preempt(i, num_new, draft):
                draft.take(seq, start, num_new)
                i += 1
            # else it was preempted itself: ``running[i]`` is now the next one

    def _allocate_or_preempt(self, i: int, num_new: int, draft: _StepDraft) -> bool:
        """Allocate ``num_new`` slots for ``running[i]``, preempting victims until they fit;
        False if ``running[i]`` itself was the victim."""
        seq = self.running[i]
        while not self.allocator.allocate(seq, num_new):
            # Only sequences not yet scheduled this step may give way (the current one too).
            victim = self.victim_policy(self.running[i:])
            self._preempt(victim, draft.swap_out)
            draft.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _swap_back_in(self, draft: _StepDraft) -> None:
        """2. Swapped-out sequences, oldest first, into fresh device blocks (``(host, device)``
        copies); they run this same step."""
        swapped = self.swapped
        while swapped and draft.budget > 0 and len(self.running) < self.max_num_seqs:
            seq = swapped[0]
            assert self.swap_space is not None
            space = self.swap_space
            back = swap_in(self.allocator, space, seq, seq.num_computed_tokens, draft.budget)
            if back is None:
                break  # first come, first served, as for admissions
            start, num_new, copies = back
            swapped.popleft()
            seq.status = _RUNNING
            seq.num_computed_tokens = start
            self.running.append(seq)
            draft.swap_in.extend(copies)
            self.num_swap_ins += 1
            self.num_swapped_blocks_in += len(copies)
            # Not an admission: prefix_hit_tokens stays 0 (blocks reused from the cache are
            # simply not copied back).
            draft.take(seq, start, num_new)

    def _admit_waiting(self, draft: _StepDraft) -> None:
        """3. Waiting sequences in order (preempted ones first): the longest cached prefix, then
        the rest of the prompt or a chunk of it. Nobody overtakes the head of the queue."""
        waiting = self.waiting
        while waiting and draft.budget > 0 and len(self.running) < self.max_num_seqs:
            seq = waiting[0]
            num_free = self.allocator.num_allocatable_blocks
            if not self._worth_trying(seq, num_free):
                break
            hit = 0 if seq.scores_prompt else self.allocator.match_prefix(seq)
            num_new = self._admission_tokens(seq.num_tokens - hit, draft.budget)
            if num_new is None:
                break
            if not self.allocator.allocate(seq, num_new, num_cached_tokens=hit):
                self._blocked = (seq.seq_id, num_free)
                break  # first come, first served: nobody overtakes the head of the queue
            waiting.popleft()
            seq.status = _RUNNING
            seq.num_computed_tokens = hit
            self.running.append(seq)
            draft.take(seq, hit, num_new, prefix_hit_tokens=hit)

    def _worth_trying(self, seq: Seq, num_free: int) -> bool:
        """Whether admitting the queue's head ``seq`` may succeed with ``num_free`` free blocks."""
        # Every admission needs at least one new block. A head refused before is retried only
        # once the free pool has grown: retrying a 10k-token prompt every step of an overloaded
        # replay costs a prefix walk each time and cannot succeed, unless a running prefill
        # meanwhile cached more of its prefix (then it waits a bit longer).
        blocked = seq.seq_id == self._blocked[0] and num_free <= self._blocked[1]
        return num_free > 0 and not blocked

    def _admission_tokens(self, num_new: int, budget: int) -> int | None:
        """The tokens to admit of a prompt needing ``num_new``: all of them, a chunk of
        ``budget``, or None when it must wait for a step with room for all of it."""
        if num_new <= budget:
            return num_new
        # Without chunked prefill a prompt waits for a step with room for all of it, but a
        # recompute (prompt + generated tokens) may never fit one step: chunk that.
        if not self.chunked_prefill and num_new <= self.max_num_batched_tokens:
            return None
        return budget

    def _close(self, draft: _StepDraft) -> ScheduledBatch:
        """The batch of ``draft``, with the fork copies, refusals and tier orders since the last
        step (taken: the next step starts without them)."""
        copies = [c for cs in self._pending_copies.values() for c in cs]
        self._pending_copies.clear()
        refused, self._refused = self._refused, []
        tiers = self.allocator.drain_tier_orders()  # empty for an allocator without lower tiers
        return ScheduledBatch(
            self._step,
            tuple(draft.seqs),
            tuple(copies),
            tuple(draft.preempted),
            tuple(refused),
            swap_out=tuple(draft.swap_out),
            swap_in=tuple(draft.swap_in),
            block_offloads=tiers.offloads,
            block_loads=tiers.loads,
            block_saves=tiers.saves,
            prefix_copies=tiers.prefix_copies,
        )

    def _preempt(self, seq: Seq, swap_copies: list[tuple[int, int]]) -> None:
        """Swap ``seq`` out (its copies appended to ``swap_copies``) when there is a swap space
        with room for all its computed blocks, else free it for recompute."""
        pending = self._pending_copies.pop(seq.seq_id, None)  # its fork copy, not applied yet
        space = self.swap_space
        if space is not None and seq.num_computed_tokens > 0:
            pairs = swap_out(self.allocator, space, seq, seq.num_computed_tokens)
            if pairs is not None:
                # A forked child's tail is still to be copied from its parent's (block_copies
                # come after swap_out in a step): save the source block instead.
                src_of = dict((dst, src) for src, dst in pending or ())
                swap_copies.extend((src_of.get(dev, dev), host) for dev, host in pairs)
                self.running.remove(seq)
                seq.status = SequenceStatus.SWAPPED
                self.swapped.append(seq)
                seq.num_preemptions += 1
                self.num_preemptions += 1
                self.num_swap_outs += 1
                self.num_swapped_blocks_out += len(pairs)
                return
            self.num_swap_fallbacks += 1
        self.allocator.free(seq, preempted=True)  # it will be admitted again
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
