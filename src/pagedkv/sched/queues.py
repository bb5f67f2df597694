"""``RequestQueues``: the scheduler's half that holds requests, not steps.

The waiting queue, the running list, the swapped queue (sequences whose KV sits in the host swap
space), each request's live sequences, the refusal rule at the door, abort and finishing. What
one step does comes on top, in two halves: ``StepRecorder`` (``sched/recorder.py``) records a
step's results (``commit_ahead``; ``update``: tokens, stops, forks) and ``Scheduler``
(``sched/scheduler.py``) plans the step (``schedule``: admission, chunking, preemption).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pagedkv.kvcache.hashing import NO_EXTRA_KEYS, HashExtraKeys
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvcache.tiers.swap_space import SwapSpace
from pagedkv.sched.limits import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from pagedkv.sched.preemption import VictimPolicy, latest_arrival
from pagedkv.sched.refusal import Refusal, never_fits
from pagedkv.sched.sequence import FinishReason, Seq, SequenceStatus

_RUNNING = SequenceStatus.RUNNING
_SWAPPED = SequenceStatus.SWAPPED


class RequestQueues:
    """Owns the waiting queue and the running list; mutates sequences and the allocator.

    ``swap_space`` given: preemption swaps the victim's blocks out to it (falling back to
    recompute when it is full); None: every preemption recomputes.

    Counters for reports: ``num_preemptions`` (swaps and recomputes), ``num_recomputed_tokens``
    (tokens computed again after a preemption, prefix hits excluded), ``num_refused``,
    ``num_swap_outs``, ``num_swap_ins``, ``num_swapped_blocks_out``, ``num_swapped_blocks_in``
    (host-device block copies ordered), ``num_swap_fallbacks`` (swap space full: recomputed).
    """

    def __init__(
        self,
        allocator: KVAllocator,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_model_len: int | None = None,
        *,
        chunked_prefill: bool = True,
        victim_policy: VictimPolicy = latest_arrival,
        swap_space: SwapSpace | None = None,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.victim_policy = victim_policy
        self.swap_space = swap_space
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.swapped: deque[Seq] = deque()  # swapped out, oldest first: they come back FIFO
        self._live: dict[str, list[Seq]] = {}  # request id -> its unfinished sequences
        self._refused: list[Seq] = []  # refused since the last schedule()
        self._pending_copies: dict[int, list[tuple[int, int]]] = {}  # forked child -> copies
        self._next_seq_id = 0
        self._blocked = (-1, 0)  # (seq id, free blocks) of the last refused admission
        self._step = 0
        # Steps ``commit_ahead`` recorded as computed before their samples (async engines).
        self._committed_steps: set[int] = set()
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_refused = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swapped_blocks_out = 0
        self.num_swapped_blocks_in = 0
        self.num_swap_fallbacks = 0

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
        scores_prompt: bool = False,
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
            scores_prompt=scores_prompt,
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
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            self._release(seq)
            seq.drop_placeholders()
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

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def check_invariants(self) -> None:
        """The allocator's invariants, the swap space's, and the queues agreeing with them:
        every swapped sequence holds host blocks and no device blocks, and nothing else holds
        host blocks. AssertionError otherwise."""
        self.allocator.check_invariants()
        space = self.swap_space
        if space is None:
            assert not self.swapped, "sequences swapped out without a swap space"
            return
        space.check_invariants()
        for seq in self.swapped:
            assert seq.status is _SWAPPED, f"{seq} in the swapped queue"
            assert space.holds(seq.seq_id), f"swapped {seq} holds no host blocks"
            assert not self.allocator.has_seq(seq), f"swapped {seq} still holds device blocks"
        assert space.num_used_blocks == sum(len(space.blocks_of(s.seq_id)) for s in self.swapped), (
            "host blocks held by sequences that are not swapped out"
        )

    def _release(self, seq: Seq) -> None:
        """Give back what a running or swapped ``seq`` holds and drop it from its queue."""
        if seq.status is _RUNNING:
            self.allocator.free(seq)
            self.running.remove(seq)
        elif seq.status is _SWAPPED:
            assert self.swap_space is not None
            self.swap_space.release(seq.seq_id)
            self.swapped.remove(seq)

    def _finish(self, seq: Seq, reason: FinishReason, finished: list[Seq]) -> None:
        self._release(seq)
        seq.drop_placeholders()  # a token scheduled ahead of the end is never drawn
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        live = self._live.get(seq.request_id)
        if live is not None:
            live.remove(seq)
            if not live:
                del self._live[seq.request_id]
        finished.append(seq)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id
