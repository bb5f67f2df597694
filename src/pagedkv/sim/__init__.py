"""The trace simulator: the engine's own Scheduler and allocators, a cost model for the model.

    runs = simulate(SimulateConfig(trace="mooncake_conversation.jsonl", max_requests=2000,
                                   gpu="H200-141GB", policies=("reserved", "vllm")))
    # [(RunResult, summary dict), ...]; or step by step:
    requests = load_trace("mooncake_conversation.jsonl", max_requests=2000)   # pagedkv.traces
    cost = fitted_cost_model("llama-3-8b", "H200-141GB")   # every op priced by the fitted clock
    runs = Comparison(requests, num_kv_slots, SchedulerConfig(max_model_len=131072), cost).run(
        expand_policies(["reserved", "vllm"]))

N replicas behind a router: ``Cluster`` (``pagedkv simulate --replicas N --router POLICY``).

Pure Python (no torch); deterministic for a given trace, synthetic seed and configuration.
Traces, synthetic workloads and the prefix rule live in ``pagedkv.traces``.
"""

from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.cluster import Cluster, ClusterResult
from pagedkv.sim.cluster_summary import summarize_cluster
from pagedkv.sim.compare import Comparison, expand_policies
from pagedkv.sim.cost_model import (
    CostModel,
    LinearCostModel,
    ModelCost,
    RooflineCostModel,
    kv_pool_bytes,
)
from pagedkv.sim.costs.kernel import KERNELS, KernelCostModel, KernelSpec, kernel_for_policy
from pagedkv.sim.gpus import GPUS, GPUSpec, get_gpu
from pagedkv.sim.scenario import Scenario
from pagedkv.sim.scenario_load import load_scenario, simulate
from pagedkv.sim.simulate_config import SimulateConfig
from pagedkv.sim.simulator import RunResult, Simulation
from pagedkv.sim.summary import summarize
from pagedkv.sim.vllm_class.clock import GPUClock
from pagedkv.sim.vllm_class.cost import FittedCostModel, fitted_cost_model

__all__ = [
    "GPUS",
    "Cluster",
    "ClusterResult",
    "Comparison",
    "CostModel",
    "FittedCostModel",
    "GPUClock",
    "GPUSpec",
    "KERNELS",
    "KernelCostModel",
    "KernelSpec",
    "LinearCostModel",
    "ModelCost",
    "RooflineCostModel",
    "RunResult",
    "Scenario",
    "SimulateConfig",
    "Simulation",
    "StepShape",
    "expand_policies",
    "fitted_cost_model",
    "get_gpu",
    "kernel_for_policy",
    "kv_pool_bytes",
    "load_scenario",
    "simulate",
    "summarize",
    "summarize_cluster",
]
