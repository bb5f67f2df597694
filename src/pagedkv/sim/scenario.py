"""One call that is "a simulate run": the twin of ``pagedkv.planner.plan.build_plan``.

    config = SimulateConfig(synthetic="requests=200,system=600", model="llama-3-8b")
    scenario = load_scenario(config)          # requests, model cost, GPU, pools, policies
    runs = scenario.run()                     # [(RunResult, summary dict), ...]
    runs = simulate(config)                   # the same in one call

``SimulateConfig`` is validated on construction (frozen; every bad value is a ``UsageError``
naming the field), so ``pagedkv simulate`` only parses flags into it and renders the results.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy
from pagedkv.planner.layout import KVLayout, load_layout
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.compare import Comparison, expand_policies
from pagedkv.sim.cost_model import ModelCost, RooflineCostModel, kv_pool_bytes
from pagedkv.sim.gpus import GPUSpec, get_gpu
from pagedkv.sim.simulator import ProgressFn, RunResult
from pagedkv.traces import (
    TraceRequest,
    generate,
    load_trace,
    parse_spec,
    rescale,
    skipped_lines_note,
)

# (policy, pool slots, number of requests) -> a progress callback for that run, or None
ProgressFactory = Callable[[Policy, int, int], ProgressFn | None]


@contextmanager
def _as_usage_error() -> Iterator[None]:
    """Constructors below validate user-given values with plain ValueError: those are the
    user's fault, so they leave as UsageError (the CLI's exit 2), keeping the message."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class SimulateConfig:
    """Everything a simulate run depends on. ``kv_memory_bytes`` empty: size the pool from
    the GPU (memory x utilization - weights - activations). ``strict``: a bad trace record is
    an error; otherwise it is skipped and listed in ``Scenario.skipped``."""

    trace: str | None = None
    synthetic: str | None = None
    model: str = "llama-3-8b"
    kv_dtype: str | None = None
    gpu: str = "A100-80GB"
    kv_memory_bytes: tuple[int, ...] = ()
    gpu_memory_utilization: float = 0.9
    activation_bytes: int = 4 * 2**30
    max_model_len: int = 32768
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    preemption: str = "latest_arrival"
    policies: tuple[str, ...] = ("reserved", "vllm")
    block_sizes: tuple[int, ...] = ()
    max_requests: int | None = None
    strict: bool = False
    rate_scale: float = 1.0
    seed: int = 0
    step_overhead_s: float = 0.002
    sample_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if (self.trace is None) == (self.synthetic is None):
            raise UsageError("give exactly one of --trace FILE or --synthetic SPEC")
        if not self.policies:
            raise UsageError("--policy: name at least one policy", "policy")
        finite = {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "rate_scale": self.rate_scale,
            "step_overhead_s": self.step_overhead_s,
            "sample_interval_s": self.sample_interval_s,
        }
        for name, value in finite.items():  # NaN passes every `<` check: test it first
            if not math.isfinite(value):
                raise UsageError(f"{name} must be a finite number, got {value}", name)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UsageError("gpu_memory_utilization must be in (0, 1]", "gpu_memory_utilization")
        positive = {"rate_scale": self.rate_scale, "sample_interval_s": self.sample_interval_s}
        for name, value in positive.items():
            if value <= 0:
                raise UsageError(f"{name} must be > 0, got {value}", name)
        if self.step_overhead_s < 0:
            raise UsageError("step_overhead_s must be >= 0", "step_overhead_s")
        if any(b < 1 for b in (*self.kv_memory_bytes, *self.block_sizes)):
            raise UsageError("KV pool sizes and block sizes must be >= 1")
        if self.max_requests is not None and self.max_requests < 1:
            raise UsageError("max_requests must be >= 1", "max_requests")


@dataclass
class Scenario:
    """A loaded, sized simulate run, ready to ``run``: the requests and everything priced."""

    config: SimulateConfig
    source: str  # the trace path or the synthetic spec, for titles
    requests: list[TraceRequest]
    layout: KVLayout
    model: ModelCost
    gpu: GPUSpec
    pools_bytes: tuple[int, ...]
    pools_slots: tuple[int, ...]
    policies: list[Policy]
    scheduler: SchedulerConfig
    cost: RooflineCostModel
    skipped: list[UsageError] = field(default_factory=list)  # bad trace records skipped

    def describe(self) -> str:
        """Two lines: the workload, then the model, GPU, pools and scheduler limits."""
        reqs, cfg = self.requests, self.config
        mean_prompt = sum(r.prompt_len_tokens for r in reqs) / len(reqs)
        mean_output = sum(r.output_len_tokens for r in reqs) / len(reqs)
        pools = ", ".join(
            f"{b / 2**30:,.2f} GiB = {n:,} tokens"
            for b, n in zip(self.pools_bytes, self.pools_slots, strict=True)
        )
        return (
            f"{self.source}: {len(reqs)} requests, mean prompt {mean_prompt:,.0f} + output "
            f"{mean_output:,.0f} tokens over {reqs[-1].arrival_time_s:,.1f} s\n"
            f"{self.layout.name}: {self.model.kv_record_bytes:,} KV bytes/token "
            f"({self.layout.kv_dtype}), weights {self.model.weight_bytes / 1e9:.1f} GB on "
            f"{self.gpu.name}; KV pool {pools}; max_model_len {cfg.max_model_len:,}, "
            f"max_num_seqs {cfg.max_num_seqs}, budget {cfg.max_num_batched_tokens:,} tokens/step"
        )

    def run(
        self, progress: ProgressFactory | None = None
    ) -> list[tuple[RunResult, dict[str, Any]]]:
        """One run per pool size and policy, in that order: ``(RunResult, summary)`` each."""
        runs: list[tuple[RunResult, dict[str, Any]]] = []
        n = len(self.requests)
        for slots in self.pools_slots:
            comparison = Comparison(
                self.requests, slots, self.scheduler, self.cost, self.config.sample_interval_s
            )
            track = None if progress is None else (lambda p, s=slots: progress(p, s, n))
            runs += comparison.run(self.policies, track)
        return runs


def _requests(config: SimulateConfig, skipped: list[UsageError]) -> tuple[list[TraceRequest], str]:
    if config.trace is not None:
        lenient = {} if config.strict else {"on_bad_line": skipped.append}
        requests = load_trace(config.trace, config.max_requests, config.rate_scale, **lenient)
        return requests, config.trace
    spec = parse_spec(config.synthetic or "")
    requests = rescale(generate(spec, config.seed, config.max_requests), config.rate_scale)
    return requests, f"synthetic {config.synthetic} (seed {config.seed})"


def load_scenario(config: SimulateConfig) -> Scenario:
    """Read or generate the requests, load the model's layout, size the pools: everything a
    run needs, checked (UsageError) before any replay starts."""
    with _as_usage_error():
        scheduler = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            preemption=config.preemption,
        )
        policies = expand_policies(config.policies, config.block_sizes)
        layout = load_layout(config.model, kv_dtype=config.kv_dtype)
        model = ModelCost.from_layout(layout)
        gpu = get_gpu(config.gpu)
        pools_bytes = config.kv_memory_bytes or (
            kv_pool_bytes(
                gpu, model.weight_bytes, config.gpu_memory_utilization, config.activation_bytes
            ),
        )
        cost = RooflineCostModel(model, gpu, config.step_overhead_s)
    pools_slots = tuple(b // model.kv_record_bytes for b in pools_bytes)
    if min(pools_slots) < config.max_model_len and any(p.allocator == "reserved" for p in policies):
        raise UsageError(
            f"a KV pool of {min(pools_slots)} tokens cannot hold one max_model_len region "
            f"({config.max_model_len}) for the reserved policy"
        )
    for policy in policies:  # the allocators refuse a pool of under two blocks (ValueError)
        if policy.block_size is not None and min(pools_slots) // policy.block_size < 2:
            raise UsageError(
                f"a KV pool of {min(pools_slots)} tokens holds fewer than 2 blocks of "
                f"{policy.block_size} tokens ({policy.name}): give a larger --kv-memory"
            )
    skipped: list[UsageError] = []
    requests, source = _requests(config, skipped)
    if not requests:
        why = f" ({skipped_lines_note(skipped)})" if skipped else ""
        raise UsageError(f"the workload has no requests{why}")
    return Scenario(
        config, source, requests, layout, model, gpu, tuple(pools_bytes), pools_slots,
        policies, scheduler, cost, skipped,
    )  # fmt: skip


def simulate(config: SimulateConfig) -> list[tuple[RunResult, dict[str, Any]]]:
    """``load_scenario(config).run()``: every (RunResult, summary) of the run."""
    return load_scenario(config).run()
