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

from collections.abc import Sequence as SequenceABC

from pagedkv.kvcache.tiers.swap_space import swap_in, swap_out
from pagedkv.sched.batch import Fork, ScheduledBatch, ScheduledSeq, StepUpdate
from pagedkv.sched.queues import RequestQueues
from pagedkv.sched.sequence import FinishReason, Seq, SequenceStatus

_RUNNING = SequenceStatus.RUNNING


class Scheduler(RequestQueues):
    """Plans and records steps over the queues of ``RequestQueues`` (same constructor)."""

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Plan one step (see the module docstring). Mutates the allocator (slots for every
        scheduled token are allocated here), the queues and the preempted sequences;
        ``num_computed_tokens`` advances only in ``update``."""
        self._step += 1
        alloc = self.allocator
        running = self.running
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted: list[Seq] = []
        swapped_out: list[tuple[int, int]] = []
        swapped_in: list[tuple[int, int]] = []

        # 1. Running sequences, in order: a decode token, or the next chunk of a prompt.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            num_new = min(seq.num_tokens - start, budget)
            if num_new == 0:  # its samples are still being drawn (``commit_ahead``): next step
                i += 1
                continue
            while not alloc.allocate(seq, num_new):
                # Only sequences not yet scheduled this step may give way (the current one too).
                victim = self.victim_policy(running[i:])
                self._preempt(victim, swapped_out)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, start, num_new, seq.samples_after(num_new), 0))
                budget -= num_new
                i += 1

        # 2. Swapped-out sequences, oldest first, unless this step preempted (they would only
        # take back what was just freed). So a step never swaps the same block out and in.
        swapped = self.swapped
        while not preempted and swapped and budget > 0 and len(running) < self.max_num_seqs:
            seq = swapped[0]
            assert self.swap_space is not None
            back = swap_in(alloc, self.swap_space, seq, seq.num_computed_tokens, budget)
            if back is None:
                break  # first come, first served, as for admissions
            start, num_new, copies = back
            swapped.popleft()
            seq.status = _RUNNING
            seq.num_computed_tokens = start
            running.append(seq)
            swapped_in.extend(copies)
            self.num_swap_ins += 1
            self.num_swapped_blocks_in += len(copies)
            # Not an admission: prefix_hit_tokens stays 0 (blocks reused from the cache are
            # simply not copied back).
            out.append(ScheduledSeq(seq, start, num_new, seq.samples_after(num_new), 0))
            budget -= num_new

        # 3. Waiting sequences in order (preempted ones first), unless this step preempted
        # (admitting now would only hand the freed blocks to a newcomer) or anyone is still
        # swapped out (they came first).
        waiting = self.waiting
        while (
            not preempted
            and not swapped
            and waiting
            and budget > 0
            and len(running) < self.max_num_seqs
        ):
            seq = waiting[0]
            num_free = alloc.num_allocatable_blocks
            # Every admission needs at least one new block. A head refused before is retried
            # only once the free pool has grown: retrying a 10k-token prompt every step of an
            # overloaded replay costs a prefix walk each time and cannot succeed, unless a
            # running prefill meanwhile cached more of its prefix (then it waits a bit longer).
            if num_free == 0 or (seq.seq_id == self._blocked[0] and num_free <= self._blocked[1]):
                break
            hit = 0 if seq.scores_prompt else alloc.match_prefix(seq)
            num_new = seq.num_tokens - hit
            if num_new > budget:
                # Without chunked prefill a prompt waits for a step with room for all of it, but
                # a recompute (prompt + generated tokens) may never fit one step: chunk that.
                if not self.chunked_prefill and num_new <= self.max_num_batched_tokens:
                    break
                num_new = budget
            if not alloc.allocate(seq, num_new, num_cached_tokens=hit):
                self._blocked = (seq.seq_id, num_free)
                break  # first come, first served: nobody overtakes the head of the queue
            waiting.popleft()
            seq.status = _RUNNING
            seq.num_computed_tokens = hit
            running.append(seq)
            out.append(ScheduledSeq(seq, hit, num_new, seq.samples_after(num_new), hit))
            budget -= num_new

        copies = [c for cs in self._pending_copies.values() for c in cs]
        self._pending_copies.clear()
        refused, self._refused = self._refused, []
        tiers = alloc.drain_tier_orders()  # empty for an allocator without lower tiers
        return ScheduledBatch(
            self._step,
            tuple(out),
            tuple(copies),
            tuple(preempted),
            tuple(refused),
            swap_out=tuple(swapped_out),
            swap_in=tuple(swapped_in),
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

    # -- an asynchronous engine: the next step scheduled before this one's samples ---------

    def commit_ahead(self, batch: ScheduledBatch) -> None:
        """Record ``batch`` as computed before its samples are drawn, so that the next
        ``schedule`` can run while the device computes it (vLLM v1's asynchronous scheduling):
        every entry's tokens count as computed now, and a sequence that draws one token gets
        that token as a placeholder (``Seq.append_placeholder``), which the next step computes
        with the drawn id (the engine feeds it from the device) and ``update`` then writes in.
        A sequence whose draw forks ``n > 1`` samples, or certainly ends it (its last allowed
        token), gets none: it waits for ``update``, as in a synchronous engine. Call once,
        right after ``schedule``; ``update(batch, ...)`` then neither advances nor appends."""
        for item in batch.seqs:
            seq = item.seq
            self._advance(seq, item)
            last = seq.num_output_tokens + 1 >= seq.max_new_tokens
            if item.num_samples == 1 and not last and seq.status is _RUNNING:
                seq.append_placeholder()
        self._committed_steps.add(batch.step)

    def _advance(self, seq: Seq, item: ScheduledSeq) -> None:
        """``item``'s tokens are computed: ``num_computed_tokens`` and the recompute count."""
        start = item.num_computed_tokens
        end = start + item.num_new_tokens
        if seq.max_computed_tokens > start:
            self.num_recomputed_tokens += min(end, seq.max_computed_tokens) - start
        seq.max_computed_tokens = max(seq.max_computed_tokens, end)
        seq.num_computed_tokens = end

    # -- after the forward pass ------------------------------------------------------------

    def update(
        self,
        batch: ScheduledBatch,
        sampled_token_ids: SequenceABC[SequenceABC[int]],
        stopped: SequenceABC[SequenceABC[bool]] | None = None,
    ) -> StepUpdate:
        """Record what the step decided. ``sampled_token_ids`` has one list per entry of
        ``batch.seqs``, ``num_samples`` long (empty while a prompt chunk needs no logits);
        ``stopped`` (same shape, optional) marks the samples the caller ended on a stop string.

        Advances ``num_computed_tokens``, appends the sampled tokens, finishes sequences on a
        stop string, a stop token or ``max_new_tokens`` (freeing their blocks), and forks the
        children of ``n > 1`` requests (draw ``j`` becomes the child of offset ``j``). Sequences
        aborted since ``schedule`` are skipped (their lists may be empty). Returns what
        finished and what forked. After ``commit_ahead(batch)`` (an asynchronous engine, which
        has scheduled the next step since): nothing advances, each token is written over its
        placeholder, and a sequence the next step preempted still records its token (its
        computation ended before the preemption took its blocks).
        ValueError if the lists do not match the batch."""
        if len(sampled_token_ids) != len(batch.seqs) or (
            stopped is not None and len(stopped) != len(batch.seqs)
        ):
            raise ValueError(f"update: token lists do not match the {len(batch.seqs)} sequences")
        result = StepUpdate([], [])
        ahead = batch.step in self._committed_steps
        self._committed_steps.discard(batch.step)
        for k, (item, tokens) in enumerate(zip(batch.seqs, sampled_token_ids, strict=True)):
            seq = item.seq
            if seq.is_finished or (seq.status is not _RUNNING and not ahead):
                continue  # finished or aborted since schedule(): nothing to record
            stops = stopped[k] if stopped is not None else [False] * len(tokens)
            if len(tokens) != item.num_samples or len(stops) != len(tokens):
                raise ValueError(
                    f"update: sequence {seq.seq_id} needs {item.num_samples} sampled tokens, "
                    f"got {len(tokens)}"
                )
            if not ahead:
                self._advance(seq, item)
            if not tokens:
                continue
            if len(tokens) > 1:
                seq.num_samples = 1  # before forking: the children are one sample each
            for j in range(1, len(tokens)):
                child = self._fork_child(seq, tokens[j], stops[j], result.finished)
                result.forked.append(Fork(seq, child, j))
            self._append(seq, tokens[0], stops[0], result.finished)
        return result

    def _append(self, seq: Seq, token_id: int, stop_string: bool, finished: list[Seq]) -> None:
        was_placeholder = seq.has_placeholder
        seq.append_token(token_id)
        reason = seq.stop_reason() or (FinishReason.STOP if stop_string else None)
        if reason is not None:
            if seq.status is SequenceStatus.WAITING:  # preempted by the step scheduled ahead
                self.waiting.remove(seq)
            self._finish(seq, reason, finished)
        elif was_placeholder and seq.status is _RUNNING:
            self.allocator.tokens_known(seq)  # the blocks its placeholder completed

    def _fork_child(
        self, parent: Seq, token_id: int, stop_string: bool, finished: list[Seq]
    ) -> Seq:
        """Fork one child of ``parent`` for an extra sample of its first token. The child shares
        the prompt's blocks (copy-on-write of the partial tail, applied next step); when the
        allocator has no block for the copy, or the batch is full, it waits and recomputes."""
        child = parent.fork(self._new_seq_id())
        self._live[parent.request_id].append(child)
        child.append_token(token_id)
        reason = child.stop_reason() or (FinishReason.STOP if stop_string else None)
        if reason is not None:  # done before it ever held a block
            self._finish(child, reason, finished)
            return child
        copies = None
        if parent.status is _RUNNING and len(self.running) < self.max_num_seqs:
            copies = self.allocator.fork(parent, child)
        if copies is None:
            child.num_computed_tokens = 0
            self.waiting.appendleft(child)
            return child
        child.status = _RUNNING
        self.running.append(child)
        if copies:
            self._pending_copies[child.seq_id] = copies
        return child
