"""One call that is "a simulate run": the twin of ``pagedkv.planner.plan.build_plan``.

    config = SimulateConfig(synthetic="requests=200,system=600", model="llama-3-8b")
    scenario = load_scenario(config)          # requests, model cost, GPU, pools, policies
    runs = scenario.run()                     # [(RunResult, summary dict), ...]
    runs = simulate(config)                   # the same in one call

``SimulateConfig`` is validated on construction (frozen; every bad value is a ``UsageError``
naming the field), so ``pagedkv simulate`` only parses flags into it and renders the results.

The clock: ``cost="fitted"`` (default) prices every op of a step with the GPU's clock fitted to
measured kernel times: the vLLM-class reference (``sim/vllm_class/cost.py``; paged policies pay the
block walk, ``reserved`` reads contiguously), or with ``clock="pagedkv-triton"`` (or such a
file) pagedkv's own engine (``sim/pagedkv_triton/cost.py``, eager or with CUDA graphs);
``cost="kernel"`` is the roofline plus each framework's assumed block walk
(``sim/costs/kernel.py``), or ``kernel`` names one backend for every paged policy;
``cost="roofline"`` is the block-size-blind roofline; ``cost_profile`` (a ``pagedkv profile``
file) replaces them all with a fitted model of a real engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy
from pagedkv.pages.head_split import rank_layout
from pagedkv.pages.layout import KVLayout, layout_from_shape
from pagedkv.pages.sources import load_shape
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.compare import Comparison, expand_policies
from pagedkv.sim.cost_model import CostModel, ModelCost, RooflineCostModel, kv_pool_bytes
from pagedkv.sim.costs.kernel import KernelCostModel, kernel_for_policy
from pagedkv.sim.gpus import GPUSpec, get_gpu
from pagedkv.sim.links import DeviceCopy, Link, device_copy, get_link, host_link_for_gpu
from pagedkv.sim.pagedkv_triton.clock import EngineClock
from pagedkv.sim.pagedkv_triton.cost import EngineCostModel
from pagedkv.sim.simulate_config import SimulateConfig
from pagedkv.sim.simulator import ProgressFn, RunResult
from pagedkv.sim.vllm_class.clock import GPUClock
from pagedkv.sim.vllm_class.cost import FittedCostModel
from pagedkv.traces import (
    TraceRequest,
    generate,
    load_trace,
    parse_spec,
    rescale,
    skipped_lines_note,
)

if TYPE_CHECKING:
    from pagedkv.sim.cluster import ClusterResult

# (policy, pool slots, number of requests) -> a progress callback for that run, or None
ProgressFactory = Callable[[Policy, int, int], ProgressFn | None]
# (policy, pool slots, number of requests, router) -> the same for one cluster run
ClusterProgressFactory = Callable[[Policy, int, int, str], ProgressFn | None]


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
    cost: CostModel  # the roofline or a profile; ``cost_for`` gives each policy's clock
    skipped: list[UsageError] = field(default_factory=list)  # bad trace records skipped
    link: Link | None = None  # prices swap transfers
    gpu_clock: tuple[GPUClock, str] | None = None  # the fitted clock and where it came from
    engine_clock: tuple[EngineClock, str] | None = None  # pagedkv's own engine's, instead

    def kernel_for(self, policy: Policy) -> str | None:
        """The attention kernel priced for ``policy`` under ``cost="kernel"``: its framework's
        (``kernel`` overrides it for paged policies; reserved always reads contiguously);
        None when the roofline or a profile is the clock."""
        cfg = self.config
        if cfg.cost_profile is not None or cfg.cost == "roofline":
            return None
        if self.engine_clock is not None:
            return "pagedkv-triton"
        if cfg.kernel is not None and policy.allocator != "reserved":
            return cfg.kernel
        return kernel_for_policy(policy.name)

    def cost_for(self, policy: Policy) -> CostModel:
        """The clock of ``policy``'s runs (``kernel_for``, else the roofline or profile)."""
        kernel = self.kernel_for(policy)
        if kernel is None:
            return self.cost
        if self.engine_clock is not None:
            engine, source = self.engine_clock
            tp = self.config.tensor_parallel  # no CUDA graphs at TP > 1: the engine's rule
            graphs = self.config.cuda_graphs is not False and tp == 1
            return EngineCostModel(self.model, self.gpu, engine, graphs, source, tp)
        if self.gpu_clock is not None:
            clock, source = self.gpu_clock
            tp = self.config.tensor_parallel
            return FittedCostModel(self.model, self.gpu, clock, kernel, tp, source)
        return KernelCostModel(self.model, self.gpu, kernel, self.config.step_overhead_s)

    @property
    def device_copy(self) -> DeviceCopy | None:
        """The partial prefix hits' device copies, priced on the GPU's memory (None with a
        cost profile: its clock is another machine's, whose copies it never measured)."""
        if self.config.cost_profile is not None:
            return None
        return device_copy(self.gpu.name, self.gpu.mem_bandwidth_bytes_per_s, self.model.num_layers)

    def clock(self) -> str:
        """One line naming the cost model (and the swap link)."""
        cfg = self.config
        if cfg.cost_profile is not None:
            text = f"cost profile {cfg.cost_profile}"
        elif cfg.cost == "roofline":
            text = "roofline cost model"
        elif self.engine_clock is not None:
            size = cfg.tensor_parallel
            graphs = "eager" if cfg.cuda_graphs is False or size > 1 else "CUDA graphs"
            ranks = f", TP {size}" if size > 1 else ""
            text = f"pagedkv's engine ({graphs}{ranks}): {self.engine_clock[1]}"
        elif self.gpu_clock is not None:
            tp = f", TP {cfg.tensor_parallel}" if cfg.tensor_parallel > 1 else ""
            text = f"fitted GPU clock{tp}: {self.gpu_clock[1]}"
        else:
            kernels = dict.fromkeys(str(self.kernel_for(p)) for p in self.policies)
            text = f"kernel cost model ({', '.join(kernels)})"
        if self.link is not None:
            text += f"; swap over {self.link.name}: {self.link.source}"
        return text

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
            f"max_num_seqs {cfg.max_num_seqs}, budget {cfg.max_num_batched_tokens:,} tokens/step; "
            f"{self.clock()}"
        )

    def run(
        self, progress: ProgressFactory | None = None
    ) -> list[tuple[RunResult, dict[str, Any]]]:
        """One run per pool size and policy, in that order: ``(RunResult, summary)`` each."""
        runs: list[tuple[RunResult, dict[str, Any]]] = []
        n = len(self.requests)
        for slots in self.pools_slots:
            track = None if progress is None else (lambda p, s=slots: progress(p, s, n))
            for policy in self.policies:
                comparison = Comparison(
                    self.requests,
                    slots,
                    self.scheduler,
                    self.cost_for(policy),
                    self.config.sample_interval_s,
                    link=self.link,
                    kv_record_bytes=self.model.kv_record_bytes,
                    device_copy=self.device_copy,
                )
                runs += comparison.run([policy], track)
        return runs

    def run_cluster(
        self, progress: ClusterProgressFactory | None = None
    ) -> list[tuple[ClusterResult, dict[str, Any]]]:
        """``config.num_replicas`` engines behind each of ``config.routing_policies``, per
        pool size and policy, in that order: ``(ClusterResult, summarize_cluster dict)``."""
        from pagedkv.sim.cluster import Cluster
        from pagedkv.sim.cluster_summary import cluster_ideal_hits, summarize_cluster

        cfg, n = self.config, len(self.requests)
        balance = (cfg.balance_abs, cfg.balance_rel)
        runs: list[tuple[ClusterResult, dict[str, Any]]] = []
        for slots in self.pools_slots:
            for policy in self.policies:
                for router in cfg.routing_policies:
                    cluster = Cluster(
                        self.requests,
                        policy,
                        slots,
                        self.scheduler,
                        self.cost_for(policy),
                        cfg.num_replicas,
                        router,
                        balance_abs=cfg.balance_abs,
                        balance_rel=cfg.balance_rel,
                        sample_interval_s=cfg.sample_interval_s,
                        progress=progress(policy, slots, n, router) if progress else None,
                        link=self.link,
                        kv_record_bytes=self.model.kv_record_bytes,
                        device_copy=self.device_copy,
                    )
                    result = cluster.run()
                    ideal = cluster_ideal_hits(self.requests, result)
                    runs.append((result, summarize_cluster(result, ideal, balance=balance)))
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
        shape = load_shape(config.model)
        layout = layout_from_shape(shape, kv_dtype=config.kv_dtype)
        model = ModelCost.from_shape(shape, kv_dtype=config.kv_dtype)
        scheduler = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            preemption=config.preemption,
            preemption_mode=config.preemption_mode,
            swap_space_slots=config.swap_space_bytes // model.kv_record_bytes,
        )
        policies = expand_policies(config.policies, config.block_sizes, config.prefix_match_units)
        gpu = get_gpu(config.gpu)
        tp = config.tensor_parallel  # each GPU holds 1/tp of the weights and of every token's KV
        pools_bytes = config.kv_memory_bytes or (
            tp
            * kv_pool_bytes(
                gpu,
                model.weight_bytes // tp,
                config.gpu_memory_utilization,
                config.activation_bytes,
            ),
        )
        cost: CostModel = RooflineCostModel(model, gpu, config.step_overhead_s)
        if config.cost_profile is not None:
            from pagedkv.sim.costs.profiled import load_cost_profile

            cost = load_cost_profile(config.cost_profile)
        gpu_clock, engine_clock = None, None
        if config.cost == "fitted" and config.cost_profile is None:
            gpu_clock, engine_clock = _fitted_clock(config, gpu, policies)
        if config.cuda_graphs is not None and engine_clock is None:
            raise UsageError(
                "--cuda-graphs applies to a pagedkv-triton clock only (--clock pagedkv-triton, "
                "or a clock calibrated from a device check)",
                "cuda_graphs",
            )
        link = None
        if config.preemption_mode == "swap":
            link = get_link(config.host_link) if config.host_link else host_link_for_gpu(gpu.name)
    rank = rank_layout(layout, tp, shape.num_heads)  # each GPU holds its KV heads of a token
    pools_slots = tuple(b // tp // rank.record_bytes for b in pools_bytes)
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
        config,
        source,
        requests,
        layout,
        model,
        gpu,
        tuple(pools_bytes),
        pools_slots,
        policies,
        scheduler,
        cost,
        skipped,
        link,
        gpu_clock,
        engine_clock,
    )


def _fitted_clock(
    config: SimulateConfig, gpu: GPUSpec, policies: list[Policy]
) -> tuple[tuple[GPUClock, str] | None, tuple[EngineClock, str] | None]:
    """The vLLM-class clock or pagedkv's engine clock ``config.clock`` names, checked against
    what the engine clock cannot price (UsageError)."""
    from pagedkv.sim.clock_presets import resolve_clock

    kind, clock, source = resolve_clock(gpu, config.clock)
    if isinstance(clock, GPUClock):
        return (clock, source), None
    assert isinstance(clock, EngineClock) and kind == "pagedkv-triton"
    if config.tensor_parallel > 1 and config.cuda_graphs:
        raise UsageError(
            "--cuda-graphs with --tensor-parallel-size > 1: pagedkv captures no graphs at TP > 1",
            "cuda_graphs",
        )
    if config.kernel is not None:
        raise UsageError(
            "--kernel picks a vLLM-class attention kernel: drop it with a pagedkv clock"
        )
    if any(p.allocator == "reserved" for p in policies):
        raise UsageError(
            "pagedkv's Triton kernels do not run the reserved policy (a GPU engine "
            "falls back to torch attention): drop it from --policy, or use "
            "--clock vllm-class"
        )
    from pagedkv.pages.triton_rules import block_size_problems

    for p in policies:
        if p.block_size is not None and (problems := block_size_problems(p.block_size)):
            raise UsageError(f"{p.name}: pagedkv's Triton kernels refuse it: {'; '.join(problems)}")
    return None, (clock, source)


def simulate(config: SimulateConfig) -> list[tuple[RunResult, dict[str, Any]]]:
    """``load_scenario(config).run()``: every (RunResult, summary) of the run."""
    return load_scenario(config).run()
