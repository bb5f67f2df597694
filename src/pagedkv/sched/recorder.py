"""``StepRecorder``: the scheduler's half that records what a step computed.

``commit_ahead`` (an asynchronous engine: a step's tokens counted as computed before its samples
are drawn) and ``update`` (the sampled tokens appended, stops, finishes, the forks of ``n > 1``
requests). ``Scheduler`` (``sched/scheduler.py``) adds the other half: ``schedule``, which plans
the step.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from pagedkv.sched.batch import Fork, ScheduledBatch, ScheduledSeq, StepUpdate
from pagedkv.sched.queues import RequestQueues
from pagedkv.sched.sequence import FinishReason, Seq, SequenceStatus

_RUNNING = SequenceStatus.RUNNING


class StepRecorder(RequestQueues):
    """Records steps' results on the queues of ``RequestQueues`` (same constructor)."""

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
        """Append ``seq``'s drawn token (over its placeholder, if any) and finish it if it ends."""
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
