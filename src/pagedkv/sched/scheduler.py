"""``Scheduler``: continuous batching over any ``KVAllocator``, with recompute preemption.

One engine step is ``batch = scheduler.schedule()``, the forward pass over ``batch.seqs``, then
``scheduler.update(batch, sampled)``. ``schedule`` serves running sequences first (a decode
token each, or the next chunk of an unfinished prompt), then admits waiting ones in arrival
order (prefix match, then a prompt chunk within the token budget). When the allocator refuses
to grow a running sequence, the victim policy picks a sequence to preempt: its blocks are freed
(full ones stay in the prefix cache) and it returns to the head of the waiting queue to be
recomputed; no new sequence is admitted in a step that preempted. A request that can never fit
(prompt + max_new_tokens beyond ``max_model_len`` or the whole pool) is refused when added.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from pagedkv.kvcache.hashing import NO_EXTRA_KEYS, HashExtraKeys
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.sched.batch import Fork, ScheduledBatch, ScheduledSeq, StepUpdate
from pagedkv.sched.preemption import VictimPolicy, latest_arrival
from pagedkv.sched.refusal import Refusal, never_fits
from pagedkv.sched.sequence import FinishReason, Seq, SequenceStatus

_RUNNING = SequenceStatus.RUNNING


class Scheduler:
    """Owns the waiting queue and the running list; mutates sequences and the allocator.

    Counters for reports: ``num_preemptions``, ``num_recomputed_tokens`` (tokens computed again
    after a preemption, prefix hits excluded), ``num_refused``.
    """

    def __init__(
        self,
        allocator: KVAllocator,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        *,
        chunked_prefill: bool = True,
        victim_policy: VictimPolicy = latest_arrival,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.victim_policy = victim_policy
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._live: dict[str, list[Seq]] = {}  # request id -> its unfinished sequences
        self._refused: list[Seq] = []  # refused since the last schedule()
        self._pending_copies: dict[int, list[tuple[int, int]]] = {}  # forked child -> copies
        self._next_seq_id = 0
        self._blocked = (-1, 0)  # (seq id, free blocks) of the last refused admission
        self._step = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_refused = 0

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        max_new_tokens: int,
        *,
        arrival_time_s: float = 0.0,
        stop_token_ids: Iterable[int] = (),
        extra_keys: HashExtraKeys = NO_EXTRA_KEYS,
        n: int = 1,
    ) -> Seq:
        """Queue a request and return its (parent) sequence. A request that can never fit is
        returned already finished with ``FinishReason.REFUSED`` and a ``finish_detail``; it is
        also reported in the next batch's ``refused``. ValueError on a duplicate live id."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already queued or running")
        seq = Seq(
            self._new_seq_id(),
            request_id,
            prompt_token_ids,
            max_new_tokens,
            arrival_time_s=arrival_time_s,
            stop_token_ids=stop_token_ids,
            extra_keys=extra_keys,
            num_samples=n,
        )
        refusal = self.refusal(seq.num_prompt_tokens, max_new_tokens, n)
        if refusal is not None:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.REFUSED
            seq.finish_detail = refusal.reason
            self._refused.append(seq)
            self.num_refused += 1
            return seq
        self._live[request_id] = [seq]
        self.waiting.append(seq)
        return seq

    def refusal(self, num_prompt_tokens: int, max_new_tokens: int, n: int = 1) -> Refusal | None:
        """Why a request of this shape would be refused (``never_fits``), or None. Reads only
        fixed facts (pool size, block size, limits): safe to call from any thread."""
        return never_fits(
            num_prompt_tokens,
            max_new_tokens,
            n,
            block_size=self.allocator.block_size,
            num_total_blocks=self.allocator.num_total_blocks,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=None if self.chunked_prefill else self.max_num_batched_tokens,
        )

    def abort(self, request_id: str) -> list[Seq]:
        """Finish every sequence of ``request_id`` with ``ABORT`` and free its blocks now.
        Returns them (empty for an unknown or already finished request). Safe between
        ``schedule`` and ``update``: ``update`` skips finished sequences."""
        seqs = self._live.pop(request_id, [])
        for seq in seqs:
            if seq.status is _RUNNING:
                self.allocator.free(seq)
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._pending_copies.pop(seq.seq_id, None)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
        return seqs

    def finish_sequence(self, seq: Seq, reason: FinishReason = FinishReason.STOP) -> bool:
        """Finish one sequence now (the engine matched a stop string, say) and free its blocks.
        Its siblings of an ``n > 1`` request go on. False (nothing changed) if it was already
        finished. Safe between ``schedule`` and ``update``: ``update`` skips it."""
        if seq.is_finished:
            return False
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._pending_copies.pop(seq.seq_id, None)
        self._finish(seq, reason, [])
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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

        # 1. Running sequences, in order: a decode token, or the next chunk of a prompt.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            num_new = min(seq.num_tokens - start, budget)
            while not alloc.allocate(seq, num_new):
                # Only sequences not yet scheduled this step may give way (the current one too).
                victim = self.victim_policy(running[i:])
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, start, num_new, seq.samples_after(num_new), 0))
                budget -= num_new
                i += 1

        # 2. Waiting sequences in order (preempted ones first), unless this step preempted:
        # admitting now would only hand the freed blocks to a newcomer.
        waiting = self.waiting
        while not preempted and waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[0]
            num_free = alloc.num_allocatable_blocks
            # Every admission needs at least one new block. A head refused before is retried
            # only once the free pool has grown: retrying a 10k-token prompt every step of an
            # overloaded replay costs a prefix walk each time and cannot succeed, unless a
            # running prefill meanwhile cached more of its prefix (then it waits a bit longer).
            if num_free == 0 or (seq.seq_id == self._blocked[0] and num_free <= self._blocked[1]):
                break
            hit = alloc.match_prefix(seq)
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
        return ScheduledBatch(
            self._step, tuple(out), tuple(copies), tuple(preempted), tuple(refused)
        )

    def _preempt(self, seq: Seq) -> None:
        self.allocator.free(seq, preempted=True)  # it will be admitted again
        self.running.remove(seq)
        self._pending_copies.pop(seq.seq_id, None)  # its copy target is gone
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

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
        finished and what forked.
        ValueError if the lists do not match the batch."""
        if len(sampled_token_ids) != len(batch.seqs) or (
            stopped is not None and len(stopped) != len(batch.seqs)
        ):
            raise ValueError(f"update: token lists do not match the {len(batch.seqs)} sequences")
        result = StepUpdate([], [])
        for k, (item, tokens) in enumerate(zip(batch.seqs, sampled_token_ids, strict=True)):
            seq = item.seq
            if seq.status is not _RUNNING:
                continue  # finished or aborted since schedule(): nothing to record
            stops = stopped[k] if stopped is not None else [False] * len(tokens)
            if len(tokens) != item.num_samples or len(stops) != len(tokens):
                raise ValueError(
                    f"update: sequence {seq.seq_id} needs {item.num_samples} sampled tokens, "
                    f"got {len(tokens)}"
                )
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            if seq.max_computed_tokens > start:
                self.num_recomputed_tokens += min(end, seq.max_computed_tokens) - start
            seq.max_computed_tokens = max(seq.max_computed_tokens, end)
            seq.num_computed_tokens = end
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
        seq.append_token(token_id)
        reason = seq.stop_reason() or (FinishReason.STOP if stop_string else None)
        if reason is not None:
            self._finish(seq, reason, finished)

    def _finish(self, seq: Seq, reason: FinishReason, finished: list[Seq]) -> None:
        if seq.status is _RUNNING:
            self.allocator.free(seq)
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        live = self._live.get(seq.request_id)
        if live is not None:
            live.remove(seq)
            if not live:
                del self._live[seq.request_id]
        finished.append(seq)

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
        if len(self.running) < self.max_num_seqs:
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

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id
