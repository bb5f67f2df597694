"""``LLMEngine``: a real model on the paged KV cache, with continuous batching.

This file holds the requests' lifecycle (check, add, abort) and the engine's face for the edges
(snapshots, stats, the replica's description); ``step()`` runs the one step loop
(``engine/step/loop.py``: schedule -> forward -> draws -> collect -> finish, synchronously or
one step ahead), which hands its results to the requests (``engine/step/record.py``). The
scheduler and the allocators are the same objects the simulator drives. A failure inside a step
is contained to the requests it can be traced to (``engine/step/containment.py``); the engine goes on
with the others.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv.events import describe_replica
from pagedkv.engine.offline import OfflineCalls
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import Prompt, check_params, check_request, tokenize
from pagedkv.engine.registry import RequestRegistry
from pagedkv.engine.requests import RequestState
from pagedkv.engine.startup import EngineParts, build_parts
from pagedkv.engine.stats import EngineInfo, EngineSnapshot, EngineStats
from pagedkv.engine.step.loop import StepLoop
from pagedkv.engine.step.record import StepRecord
from pagedkv.engine.step.stats_recorder import StatsRecorder
from pagedkv.engine.step.timeline import NullTimeline, StepTimeline
from pagedkv.engine.structured.grammar import GrammarCache
from pagedkv.errors import RankFailure, UsageError
from pagedkv.kvcache.hashing import HashExtraKeys

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
        record = StepRecord(
            self._registry, self.scheduler, self.recorder, self.grammars, self.runner, p.kv_events
        )
        # Scheduling one step ahead (``engine/step/loop.py``): by default where the model runs
        # on a GPU, whose steps the host can then prepare while the previous one computes.
        ahead = self.config.async_scheduling
        if ahead is None:
            ahead = self.runner.device.type == "cuda"
        self.loop = StepLoop(self.scheduler, self.runner, self.allocator, record, ahead)

    max_model_len = property(lambda self: self.info.max_model_len)
    # Whether ``step`` schedules one step ahead: a step's outputs then come back one call later.
    steps_ahead = property(lambda self: self.loop.ahead)
    # The requests a failure inside a step ended (the rest went on).
    num_failed_requests = property(lambda self: self.loop.record.num_failed_requests)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks' processes (nothing at one rank); the engine
        cannot step afterwards. Idempotent; also run at exit."""
        if self.parts.ranks is not None:
            self.parts.ranks.close()

    @property
    def ranks_failure(self) -> str | None:
        """Why a tensor-parallel rank ended this engine (one line), or None. Any thread."""
        ranks = self.parts.ranks
        workers = ranks.workers if ranks is not None else None
        return workers.failure if workers is not None else None

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
        check_request(
            prompt_token_ids,
            params,
            self.info.vocab_size,
            self.scheduler.refusal,
            self.grammars.compile,
        )

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
        busy = self.loop.busy or self.scheduler.has_unfinished()
        return busy or bool(self._registry) or bool(self._stash)

    # -- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step (``engine/step/loop.py``); returns the requests whose state
        changed (finished ones for the last time: the engine forgets them afterwards), and the
        outputs ``generate`` / ``stream`` stepped past. Never raises because of one request: a
        failure in the forward pass or the sampler fails the requests it is traced to
        (``error`` set, blocks freed) and the others go on. ``RankFailure`` once a
        tensor-parallel rank has failed: the engine is over."""
        if (why := self.ranks_failure) is not None:  # its ranks are gone: it cannot step
            raise RankFailure(why)
        outputs = self.loop.step()
        stashed, self._stash = list(self._stash.values()), {}
        return stashed + outputs

    def attach_timeline(self, timeline: StepTimeline | NullTimeline) -> None:
        """Time every step's phases into ``timeline`` (``engine/step/timeline.py``) from now on;
        ``NULL_TIMELINE`` detaches it."""
        self.loop.timeline = self.runner.timeline = timeline

    @property
    def timeline(self) -> StepTimeline | NullTimeline:
        return self.loop.timeline

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
        server does too, so a snapshot owed after a Redis outage goes out). Engine thread only.
        ``RankFailure`` when a tensor-parallel rank has failed meanwhile (an idle server learns
        it here, within its idle wake)."""
        if (why := self.ranks_failure) is not None:
            raise RankFailure(why)
        self.loop.record.publish_kv_events()
