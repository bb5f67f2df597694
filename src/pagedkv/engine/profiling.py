"""Timing the real engine's steps, for the simulator's fitted cost (``pagedkv profile``).

``StepRecorder`` times whole ``LLMEngine.step()`` calls (schedule, copy-on-write copies, the
forward pass, sampling, detokenizing, stop strings, scheduler update: everything a served step
pays) and notes the ``StepShape`` of the batch each one ran, the same shape the simulator prices.
``profile_engine`` drives engines through a grid of known batches: single prompts of several
lengths (prefill), then, per context length, a batch of prompts prefilled together (chunked
prefill steps under the token budget) and decoded at several batch sizes (requests aborted
between sizes, so one prefill serves every size). Prompts in a decode batch spread evenly over
[1, 2L] tokens (mean L, longest twice the mean), as in the batches of a real trace: the
attention pads a batch to its longest context, which a batch of equal lengths would hide.
"""

from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.errors import UsageError
from pagedkv.pages.kv_dtypes import get_kv_dtype
from pagedkv.pages.layout import layout_from_shape
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sched.step_shape import StepShape, TimedStep

# How a step is timed. "wall": elapsed time, what a user waits. "cpu": CPU time of this
# process, which on a quiet machine with one torch thread is the same number, and on a shared
# machine leaves out the time other processes held the core (valid with one thread only: with
# more, CPU time adds up over threads).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def step_shape(batch: ScheduledBatch, block_size: int) -> StepShape:
    """What ``batch`` computes, counted as ``sim/simulator.py`` counts it for its cost model."""
    return StepShape.of(
        ((item.num_computed_tokens, item.num_new_tokens) for item in batch.seqs), block_size
    )


class StepRecorder:
    """Wraps one engine's steps: ``step()`` runs ``engine.step()`` and returns its outputs;
    afterwards ``last`` is the ``TimedStep`` it ran (None for a step that scheduled nothing) and
    ``last_running`` the running sequences right after scheduling, before finished ones leave
    (where the simulator counts its peak); ``first_token_s`` maps each request id to the
    ``clock`` time its first token came back. Observes the scheduler without changing what it
    decides. ``clock``: a ``CLOCKS`` name. The engine must step synchronously
    (``async_scheduling=False``): one step ahead, a call's time is not its batch's."""

    def __init__(self, engine: LLMEngine, clock: str = "wall") -> None:
        if engine.steps_ahead:
            raise ValueError(
                "StepRecorder times synchronous steps: build the engine with async_scheduling=False"
            )
        self.engine = engine
        self.clock = CLOCKS[clock]
        self.block_size = engine.info.block_size
        self.last: TimedStep | None = None
        self.last_running = 0
        self.first_token_s: dict[str, float] = {}
        self._batch: ScheduledBatch | None = None
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def observed_schedule() -> ScheduledBatch:
            self._batch = schedule()
            self.last_running = len(scheduler.running)
            return self._batch

        scheduler.schedule = observed_schedule  # type: ignore[method-assign]

    def step(self) -> list[RequestOutput]:
        self._batch = None
        started = self.clock()
        outputs = self.engine.step()
        ended = self.clock()
        seconds = ended - started
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                self.first_token_s.setdefault(out.request_id, ended)
        batch = self._batch
        self.last = None
        if batch is not None and batch.seqs:
            self.last = TimedStep(step_shape(batch, self.block_size), seconds)
        return outputs


@dataclass(frozen=True)
class ProfilePlan:
    """The grid ``profile_engine`` measures (the defaults are ``pagedkv profile``'s flags)."""

    block_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    steps_per_point: int
    max_num_batched_tokens: int

    @property
    def num_points(self) -> int:
        per_block = len(self.prefill_lens) + len(self.context_lens) * len(self.batch_sizes)
        return per_block * len(self.block_sizes)

    def max_tokens_per_seq(self) -> int:
        """The longest a profiled sequence gets: its prompt plus every decode step (those of
        the batch's chunked prefill included: ``_decode_points``)."""
        longest = max(max(self.prefill_lens), 2 * max(self.context_lens))
        batch_prompt_tokens = max(self.batch_sizes) * max(self.context_lens) + max(self.batch_sizes)
        prefill_steps = -(-batch_prompt_tokens // self.max_num_batched_tokens) + 1
        return longest + self.steps_per_point * len(self.batch_sizes) + 2 + prefill_steps


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Random ids: no two prompts share a block, so no prefix hit shortens a measured step."""
    return [rng.randrange(vocab_size) for _ in range(max(1, length))]


def profile_engine(
    loaded: tuple[Any, Any, Any],
    base: EngineConfig,
    plan: ProfilePlan,
    on_point: Callable[[str], None] | None = None,
    seed: int = 0,
    clock: str = "wall",
) -> list[TimedStep]:
    """Time every step of ``plan`` on engines built from ``base`` (one per block size, the
    model ``loaded`` once; under tensor parallelism, whose ranks load their shares, each
    engine loads its own and ``loaded`` holds the config alone), timed on ``clock``;
    ``on_point(label)`` after each grid point. Returns the samples."""
    context = loaded[0].max_position_embeddings
    if plan.max_tokens_per_seq() > context:
        raise UsageError(
            f"the profile's longest sequence ({plan.max_tokens_per_seq()} tokens: prompt + "
            f"decode steps) exceeds the model's context of {context}: give shorter "
            "--prefill-lens / --context-lens"
        )
    rng = random.Random(seed)
    samples: list[TimedStep] = []
    for block_size in plan.block_sizes:
        config = _engine_config(base, loaded[0], plan, block_size)
        own = config.tensor_parallel_size > 1
        engine = LLMEngine(config, parts=build_parts(config, None if own else loaded))
        try:
            samples += _profile_one(engine, plan, block_size, rng, clock, on_point)
        finally:
            engine.close()
    return samples


def _profile_one(
    engine: LLMEngine,
    plan: ProfilePlan,
    block_size: int,
    rng: random.Random,
    clock: str,
    on_point: Callable[[str], None] | None,
) -> list[TimedStep]:
    """One engine's grid points (one block size)."""
    samples: list[TimedStep] = []
    rec = StepRecorder(engine, clock)
    vocab = engine.info.vocab_size
    engine.add_request(_prompt(rng, 8, vocab), _params(2))
    _run_to_end(rec)  # warm-up: the first step of an engine pays one-time costs
    for length in plan.prefill_lens:
        engine.add_request(_prompt(rng, length, vocab), _params(1))
        samples += _run_to_end(rec)
        if on_point:
            on_point(f"B={block_size} prefill {length}")
    for context in plan.context_lens:
        samples += _decode_points(rec, plan, context, rng, on_point)
    return samples


def _engine_config(base: EngineConfig, model_config: Any, plan: ProfilePlan, block_size: int):
    seq_tokens = plan.max_tokens_per_seq() + block_size
    batch = max(plan.batch_sizes)
    record_bytes = kv_record_bytes(model_config, base.dtype)
    return replace(
        base,
        block_size=block_size,
        max_num_seqs=batch,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        max_model_len=min(model_config.max_position_embeddings, seq_tokens),
        kv_cache_memory_bytes=(batch * seq_tokens + 2 * block_size) * record_bytes,
        log_startup=False,
        async_scheduling=False,  # each step timed alone: what the simulator's step model prices
    )


def kv_record_bytes(model_config: Any, dtype: str) -> int:
    """Bytes of one token's K and V over all layers in the engine's pool (to size a pool in
    blocks: ``kv_cache_memory_bytes = num_blocks * block_size * kv_record_bytes``)."""
    return layout_from_shape(model_config.model_shape(), get_kv_dtype(dtype).name).record_bytes


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _run_to_end(rec: StepRecorder) -> list[TimedStep]:
    samples = []
    while rec.engine.has_unfinished():
        rec.step()
        if rec.last is not None:
            samples.append(rec.last)
    return samples


def _decode_points(
    rec: StepRecorder,
    plan: ProfilePlan,
    context: int,
    rng: random.Random,
    on_point: Callable[[str], None] | None,
) -> list[TimedStep]:
    """One batch of the largest size prefilled (its steps are samples too), then
    ``steps_per_point`` decode steps per batch size, largest first."""
    engine, samples = rec.engine, []
    sizes = sorted(plan.batch_sizes, reverse=True)
    n, vocab = sizes[0], engine.info.vocab_size
    spread = [max(1, 2 * context * i // (n - 1)) for i in range(n)] if n > 1 else [context]
    # Every request must outlive the chunked prefill of the whole batch (the first prompts
    # decode during it) and then every point: else the largest sizes are never measured (the
    # H200 check's 256 x 1,024 point ran 71 sequences: 17-token requests ended mid-prefill).
    prefill_steps = -(-sum(spread) // plan.max_num_batched_tokens) + 1
    params = _params(plan.steps_per_point * len(sizes) + 2 + prefill_steps)
    ids = [engine.add_request(_prompt(rng, length, vocab), params) for length in spread]
    rng.shuffle(ids)  # abort a random subset at each size: the context spread stays
    while any(i not in rec.first_token_s for i in ids):
        rec.step()
        if rec.last is not None:
            samples.append(rec.last)
    for size in sizes:
        for request_id in ids[size:]:
            engine.abort(request_id)
        ids = ids[:size]
        for _ in range(plan.steps_per_point):
            rec.step()
            if rec.last is not None:
                samples.append(rec.last)
        if on_point:
            on_point(f"B={rec.block_size} decode {size} x ~{context}")
    for request_id in ids:
        engine.abort(request_id)
    _run_to_end(rec)
    return samples


def machine_meta(threads: int) -> dict[str, Any]:
    """Where the profile was measured: it is only valid there."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), cpu)
    except OSError:
        pass
    return {
        "machine": f"{cpu} ({os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()})",
        "hostname": platform.node(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
