"""``LLMEngine``: a real model on the paged KV cache, with continuous batching.

One ``step()`` reads as: schedule -> execute (copy-on-write copies, then the forward pass over
every scheduled sequence's new tokens) -> sample -> record the text (stop strings) -> update the
scheduler, which finishes, frees and forks. The scheduler and the allocators are the same
objects the simulator drives. A failure inside a step is contained to the requests it can be
traced to (``engine/containment.py``); the engine goes on with the others.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence

from pagedkv.engine.ahead import AheadStepper
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.containment import run_contained
from pagedkv.engine.grammar import GrammarCache, GrammarError
from pagedkv.engine.kv.events import describe_replica
from pagedkv.engine.offline import OfflineCalls
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompt_scoring import score_prompts
from pagedkv.engine.prompts import Prompt, check_params, check_request, tokenize
from pagedkv.engine.registry import RequestRegistry
from pagedkv.engine.requests import RequestState, partial_hit
from pagedkv.engine.runner import StepOutput
from pagedkv.engine.sample_step import Draws, sample_batch
from pagedkv.engine.startup import EngineParts, build_parts
from pagedkv.engine.stats import EngineInfo, EngineSnapshot, EngineStats, StatsRecorder
from pagedkv.engine.timeline import NULL_TIMELINE, NullTimeline, StepTimeline
from pagedkv.errors import UsageError
from pagedkv.kvcache.hashing import HashExtraKeys
from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq
from pagedkv.sched.sequence import Seq

log = logging.getLogger("pagedkv.engine")


class LLMEngine(OfflineCalls):
    """Not thread-safe: one caller (or the server's engine loop) drives ``step``; ``info`` and
    ``check_request`` read fixed facts only and may be used from any thread."""

    def __init__(self, config: EngineConfig | None = None, parts: EngineParts | None = None):
        """Load the model and build the KV pool, allocator and scheduler. ``parts`` injects an
        already loaded model (tests, benchmarks) instead of ``config.model``."""
        self.config = config or EngineConfig()
        self.parts = parts or build_parts(self.config)
        p = self.parts
        self.tokenizer, self.allocator = p.tokenizer, p.allocator
        self.scheduler, self.runner = p.scheduler, p.runner
        if self.config.log_startup:
            print(p.startup_report, file=sys.stderr)
        self.info = EngineInfo.from_parts(p)
        self.grammars = GrammarCache(self.tokenizer, p.model_config.vocab_size)
        self._registry = RequestRegistry()
        # Outputs that generate() / stream() stepped past (other requests', aborts), newest per
        # request: handed to the next step() caller instead of being lost.
        self._stash: dict[str, RequestOutput] = {}
        self.recorder = StatsRecorder(self.allocator, self.runner.swap_pool, self.info.record_bytes)
        mover = self.runner.mover
        self.recorder.tier_counts = mover.counts if mover.has_tiers else None
        self._store = p.kv_store  # None without ``--kv-store``
        self.recorder.store_counters = self._store.counters if self._store else None
        self.num_failed_requests = 0
        # Scheduling one step ahead (``engine/ahead.py``): by default where the model runs on
        # a GPU, whose steps the host can then prepare while the previous one computes.
        ahead = self.config.async_scheduling
        if ahead is None:
            ahead = self.runner.device.type == "cuda"
        self._ahead = AheadStepper(self) if ahead else None
        self.timeline: StepTimeline | NullTimeline = NULL_TIMELINE  # ``attach_timeline``

    max_model_len = property(lambda self: self.info.max_model_len)
    # Whether ``step`` schedules one step ahead: a step's outputs then come back one call later.
    steps_ahead = property(lambda self: self._ahead is not None)

    def flush_kv_store(self, timeout_s: float = 30.0) -> bool:
        """Wait until every block written through to the KV store so far has been sent (True;
        False on timeout or with no store). Safe from any thread: it only waits on the
        store's writer."""
        return self._store.flush(timeout_s) if self._store is not None else False

    # -- requests --------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """``UsageError`` (``param`` names the field) for a request that can never run: no
        prompt, prompt/stop/biased ids outside the vocabulary, prompt + ``max_tokens`` past the
        context, samples the whole pool can never hold (the scheduler's refusal), a structure
        xgrammar refuses (compiled here, and cached). Thread-safe."""
        check_request(prompt_token_ids, params, self.info.vocab_size, self.scheduler.refusal,
                      self.grammars.compile)  # fmt: skip

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request (text, or token ids); returns its id. ``UsageError`` for a request
        ``check_request`` refuses, a prompt of the wrong type, or an id in use: nothing is
        queued then."""
        text, token_ids = tokenize(self.tokenizer, prompt)
        return self._add(text, token_ids, check_params(params), request_id, cache_salt)

    def _add(
        self,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
    ) -> str:
        self.check_request(token_ids, params)
        if request_id is None:
            request_id = self._registry.new_id("req")
        elif request_id in self._registry:
            raise UsageError(f"request id {request_id!r} is already in use", param="request_id")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.tokenizer.stop_token_ids
        seq = self.scheduler.add_request(
            request_id,
            token_ids,
            params.max_tokens,
            stop_token_ids=stops,
            extra_keys=HashExtraKeys(cache_salt=cache_salt),
            n=params.n,
            scores_prompt=params.prompt_logprobs is not None,
        )
        matchers = self.grammars.matchers(params.structured, params.n)
        state = RequestState(request_id, text, token_ids, params, self.tokenizer, matchers)
        self._registry.add(state, seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done. No
        output follows for it (the ``stream()`` that runs it ends)."""
        state = self._registry.by_id.get(request_id)
        if state is None or state.finished:
            return False
        self.scheduler.abort(request_id)
        state.mark_aborted()
        self._stash.pop(request_id, None)
        self._registry.forget(state)
        return True

    def has_unfinished(self) -> bool:
        """Whether a request is still running or waits to report."""
        busy = self._ahead is not None and self._ahead.busy
        return busy or self.scheduler.has_unfinished() or bool(self._registry) or bool(self._stash)

    # -- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests whose state changed (finished ones for
        the last time: the engine forgets them afterwards). Never raises because of one
        request: a failure in the forward pass or the sampler fails the requests it is traced
        to (``error`` set, blocks freed) and the others go on."""
        tl = self.timeline
        tl.begin()
        if self._ahead is not None:  # the next step scheduled while this one computes
            outputs, batch = self._ahead.step()
        else:
            started = time.perf_counter()
            batch, touched = self.schedule_step()
            tl.mark("schedule")
            draws, failures = run_contained(batch, self._execute_and_sample)
            outputs = self.finish_step(batch, draws, failures, touched, started)
        decode_rows = sum(item.num_new_tokens == 1 for item in batch.seqs)
        tl.end(len(batch.seqs), batch.num_batched_tokens, decode_rows)
        return outputs

    def attach_timeline(self, timeline: StepTimeline | NullTimeline) -> None:
        """Time every step's phases into ``timeline`` (``engine/timeline.py``) from now on;
        ``NULL_TIMELINE`` detaches it."""
        self.timeline = self.runner.timeline = timeline

    def schedule_step(self) -> tuple[ScheduledBatch, set[str]]:
        """The scheduler's next batch, its refusals handed to their requests (their ids in the
        returned set of requests to report). Engine thread only."""
        batch = self.scheduler.schedule()
        owner = self._registry.owner
        touched = {owner(s).request_id for s in batch.refused}
        for seq in batch.refused:
            owner(seq).refuse(seq.finish_detail)
        return batch, touched

    def finish_step(
        self,
        batch: ScheduledBatch,
        draws: list[Draws | None],
        failures: list[tuple[ScheduledSeq, Exception]],
        touched: set[str],
        started: float,
    ) -> list[RequestOutput]:
        """Everything after the draws of ``batch``: its failures, the tokens into each
        request (stop strings), the scheduler's update, finished samples, stats and KV events;
        returns the outputs to report. Engine thread only."""
        owner = self._registry.owner
        for item, exc in failures:
            if (state := self._registry.find(item.seq)) is not None:  # None: ended already
                touched.add(self._fail(state, exc))
        self.recorder.record_step(batch, started)  # before update() frees finished sequences
        tokens, stopped = self._record(batch, draws, touched)
        self.timeline.mark("record")
        done = self.scheduler.update(batch, tokens, stopped)
        self._registry.adopt(done.forked)
        for seq in done.finished:
            owner(seq).finish_sample(seq)
        self.recorder.end_step()
        self.publish_kv_events()
        outputs, self._stash = list(self._stash.values()), {}
        return outputs + self._registry.report(touched)

    def _execute_and_sample(self, batch: ScheduledBatch) -> list[Draws | Exception]:
        out = self.runner.execute(batch, self.allocator)
        self.score_prompts(batch, out)
        draws = sample_batch(batch, out.logits, self.sampling_of)
        self.timeline.mark("sample")
        return draws

    def score_prompts(self, batch: ScheduledBatch, out: StepOutput) -> None:
        """Prompt logprobs of the positions ``batch`` computed (``out``: its forward's)."""
        score_prompts(batch, out.prompt_hidden, self.runner.model.compute_logits,
                      self._registry.find)  # fmt: skip

    def sampling_of(self, seq: Seq) -> tuple[SamplingParams, int, list | None]:
        state = self._registry.owner(seq)
        return state.params, state.sample_index(seq), state.matchers

    def _record(
        self, batch: ScheduledBatch, draws: list[Draws | None], touched: set[str]
    ) -> tuple[list[list[int]], list[list[bool]]]:
        """Hand each sampled token to its request's text (stop strings are found here) and
        build ``update``'s arguments. Entries whose request failed pass no tokens."""
        tokens: list[list[int]] = []
        stopped: list[list[bool]] = []
        copied = {c.dst_block: c.num_tokens for c in batch.prefix_copies}
        for item, drawn in zip(batch.seqs, draws, strict=True):
            state = self._registry.find(item.seq)
            if drawn is None or state is None or item.seq.is_finished:
                tokens.append([])
                stopped.append([])
                continue
            partial = partial_hit(item, self.allocator, self.info.block_size, copied)
            state.note_admission(item.seq, item.prefix_hit_tokens, *partial)
            ids, logprobs, complete = drawn
            first = state.sample_index(item.seq)
            pairs = enumerate(zip(ids, logprobs, complete, strict=True))
            stopped.append([state.record_token(first + j, t, lp, c) for j, (t, lp, c) in pairs])
            tokens.append(ids)
            if ids:
                touched.add(state.request_id)
        return tokens, stopped

    def _fail(self, state: RequestState, exc: BaseException) -> str:
        """End ``state`` with the failure: abort its sequences (frees their blocks)."""
        spec = state.params.structured
        if isinstance(exc, GrammarError) and spec is not None:
            self.grammars.forget(spec)  # its samples' copies share the prototype's lexer
        if not state.finished:
            log.error("request %s failed inside a step: %r", state.request_id, exc, exc_info=exc)
            self.num_failed_requests += 1
            self.scheduler.abort(state.request_id)
            if isinstance(exc, GrammarError) and spec is not None:
                state.fail(f"{spec.param}: {exc}", param=spec.param)
            else:
                state.fail(f"the request failed inside the engine: {type(exc).__name__}: {exc}")
        return state.request_id

    # -- the engine's one face for the edges -----------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """The state between two steps (pool, queues, counters). Engine thread only."""
        return self.recorder.snapshot(self.scheduler, len(self._registry), self.num_failed_requests)

    def stats(self) -> EngineStats:
        return self.recorder.summary(self.scheduler)

    def describe(self, served_model_name: str) -> dict:
        """The replica's self-description for routers (``GET /pagedkv/info``), with the
        weights' digest computed once at start-up. Safe from any thread."""
        return describe_replica(self, served_model_name, self.parts.model_identity)

    def kv_event_counts(self) -> Callable[[], dict[str, int]] | None:
        """The KV event publisher's counters (a callable), or None without ``--kv-events``."""
        return self.parts.kv_events and self.parts.kv_events.counts

    def publish_kv_events(self) -> None:
        """Publish the prefix cache's changes since the last call (each step calls it; an idle
        server does too, so a snapshot owed after a Redis outage goes out). Engine thread only."""
        if self.parts.kv_events is not None:
            self.parts.kv_events.after_step()
