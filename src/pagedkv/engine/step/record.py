"""``StepRecord``: the requests' side of a step, what the step loop (``step/loop.py``) hands
its results to. Refusals to their requests, sampled tokens into each request's text (stop
strings are found there), the scheduler's ``update`` (finishes, frees, forks), failures traced
to their requests (``containment.py``), the stats and the KV events."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pagedkv.engine.kv.events import EngineKVEvents
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompt_scoring import score_prompts
from pagedkv.engine.registry import RequestRegistry
from pagedkv.engine.requests import RequestState, partial_hit
from pagedkv.engine.runner import ModelRunner, StepOutput
from pagedkv.engine.step.containment import Failures
from pagedkv.engine.step.draws import Draws
from pagedkv.engine.step.stats_recorder import StatsRecorder
from pagedkv.engine.step.timeline import NullTimeline, StepTimeline
from pagedkv.engine.structured.grammar import GrammarCache, GrammarError
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sched.sequence import Seq

log = logging.getLogger("pagedkv.engine")


class StepRecord:
    """Engine thread only. ``num_failed_requests``: the requests a failure inside a step
    ended (the rest went on)."""

    def __init__(
        self,
        registry: RequestRegistry,
        scheduler: Scheduler,
        recorder: StatsRecorder,
        grammars: GrammarCache,
        runner: ModelRunner,
        kv_events: EngineKVEvents | None,
    ) -> None:
        self.registry, self.scheduler, self.recorder = registry, scheduler, recorder
        self.grammars, self.runner, self.kv_events = grammars, runner, kv_events
        self.num_failed_requests = 0

    def refuse(self, refused: Sequence[Seq]) -> set[str]:
        """Hand the scheduler's refusals to their requests; the ids of the requests to report."""
        owner = self.registry.owner
        for seq in refused:
            owner(seq).refuse(seq.finish_detail)
        return {owner(s).request_id for s in refused}

    def sampling_of(self, seq: Seq) -> tuple[SamplingParams, int, list | None]:
        """(its params, its sample index, its request's grammar matchers or None)."""
        state = self.registry.owner(seq)
        return state.params, state.sample_index(seq), state.matchers

    def score_prompts(self, batch: ScheduledBatch, out: StepOutput) -> None:
        """Prompt logprobs of the positions ``batch`` computed (``out``: its forward's)."""
        logits = self.runner.compute_logits
        score_prompts(batch, out.prompt_hidden, logits, self.registry.find)

    def finish(
        self,
        batch: ScheduledBatch,
        draws: list[Draws | None],
        failures: Failures,
        touched: set[str],
        started: float,
        timeline: StepTimeline | NullTimeline,
    ) -> list[RequestOutput]:
        """Everything after the draws of ``batch``: its failures, the tokens into each
        request, the scheduler's update, finished samples, stats and KV events; returns the
        outputs to report."""
        for item, exc in failures:
            if (state := self.registry.find(item.seq)) is not None:  # None: ended already
                touched.add(self._fail(state, exc))
        self.recorder.record_step(batch, started)  # before update() frees finished sequences
        tokens, stopped = self._record(batch, draws, touched)
        timeline.mark("record")
        done = self.scheduler.update(batch, tokens, stopped)
        self.registry.adopt(done.forked)
        for seq in done.finished:
            self.registry.owner(seq).finish_sample(seq)
        self.recorder.end_step()
        self.publish_kv_events()
        return self.registry.report(touched)

    def publish_kv_events(self) -> None:
        """Publish the prefix cache's changes since the last call (each step calls it; an idle
        server does too, so a snapshot owed after a Redis outage goes out)."""
        if self.kv_events is not None:
            self.kv_events.after_step()

    def _record(
        self, batch: ScheduledBatch, draws: list[Draws | None], touched: set[str]
    ) -> tuple[list[list[int]], list[list[bool]]]:
        """Hand each sampled token to its request's text (stop strings are found here) and
        build ``update``'s arguments. Entries whose request failed pass no tokens."""
        tokens: list[list[int]] = []
        stopped: list[list[bool]] = []
        copied = {c.dst_block: c.num_tokens for c in batch.prefix_copies}
        allocator = self.scheduler.allocator
        for item, drawn in zip(batch.seqs, draws, strict=True):
            state = self.registry.find(item.seq)
            if drawn is None or state is None or item.seq.is_finished:
                tokens.append([])
                stopped.append([])
                continue
            partial = partial_hit(item, allocator, allocator.block_size, copied)
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
        """End ``state`` with the failure: abort its sequences (frees their blocks). A grammar
        that failed is dropped from the cache (its samples' copies share one lexer) and the
        error names the request's field."""
        spec = state.params.structured
        grammar = isinstance(exc, GrammarError) and spec is not None
        if grammar:
            self.grammars.forget(spec)
        if not state.finished:
            log.error("request %s failed inside a step: %r", state.request_id, exc, exc_info=exc)
            self.num_failed_requests += 1
            self.scheduler.abort(state.request_id)
            if grammar:
                state.fail(f"{spec.param}: {exc}", param=spec.param)
            else:
                state.fail(f"the request failed inside the engine: {type(exc).__name__}: {exc}")
        return state.request_id
