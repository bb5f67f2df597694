"""``Scenario``: a loaded, sized simulate run, ready to ``run``: the requests and everything
priced (``sim/scenario_load.py`` builds it from a ``SimulateConfig``).

Its clock: ``cost="fitted"`` (default) prices every op of a step with the GPU's clock fitted to
measured kernel times: the vLLM-class reference (``sim/vllm_class/cost.py``; paged policies pay the
block walk, ``reserved`` reads contiguously), or with ``clock="pagedkv-triton"`` (or such a
file) pagedkv's own engine (``sim/pagedkv_triton/cost.py``, eager or with CUDA graphs);
``cost="kernel"`` is the roofline plus each framework's assumed block walk
(``sim/costs/kernel.py``), or ``kernel`` names one backend for every paged policy;
``cost="roofline"`` is the block-size-blind roofline; ``cost_profile`` (a ``pagedkv profile``
file) replaces them all with a fitted model of a real engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy
from pagedkv.pages.layout import KVLayout
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.compare import Comparison
from pagedkv.sim.cost_model import CostModel, ModelCost
from pagedkv.sim.costs.kernel import KernelCostModel, kernel_for_policy
from pagedkv.sim.gpus import GPUSpec
from pagedkv.sim.links import DeviceCopy, Link, device_copy
from pagedkv.sim.pagedkv_triton.clock import EngineClock
from pagedkv.sim.pagedkv_triton.cost import EngineCostModel
from pagedkv.sim.simulate_config import SimulateConfig
from pagedkv.sim.simulator import ProgressFn, RunResult
from pagedkv.sim.vllm_class.clock import GPUClock
from pagedkv.sim.vllm_class.cost import FittedCostModel
from pagedkv.traces import TraceRequest

if TYPE_CHECKING:
    from pagedkv.sim.cluster import ClusterResult

# (policy, pool slots, number of requests) -> a progress callback for that run, or None
ProgressFactory = Callable[[Policy, int, int], ProgressFn | None]
# (policy, pool slots, number of requests, router) -> the same for one cluster run
ClusterProgressFactory = Callable[[Policy, int, int, str], ProgressFn | None]


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
