"""The trace simulator: the engine's own Scheduler and allocators, a cost model for the model.

    requests = load_trace("mooncake_conversation.jsonl", max_requests=2000)
    cost = RooflineCostModel(ModelCost.from_layout(load_layout("llama-3-8b")), get_gpu("H200-141GB"))
    runs = Comparison(requests, num_kv_slots, SchedulerConfig(max_model_len=131072), cost).run(
        expand_policies(["reserved", "vllm"]))      # [(RunResult, summary dict), ...]

Pure Python (no torch); deterministic for a given trace, synthetic seed and configuration.
"""

from pagedkv.sim.compare import Comparison, expand_policies
from pagedkv.sim.cost_model import (
    CostModel,
    LinearCostModel,
    ModelCost,
    RooflineCostModel,
    StepShape,
    kv_pool_bytes,
)
from pagedkv.sim.gpus import GPUS, GPUSpec, get_gpu
from pagedkv.sim.prefix_oracle import ideal_prefix_hit_tokens, shared_prefix_tokens
from pagedkv.sim.simulator import RunResult, Simulation
from pagedkv.sim.summary import summarize
from pagedkv.sim.synthetic import SyntheticSpec, generate, parse_spec
from pagedkv.sim.traces import TraceRequest, load_trace, segment_tokens

__all__ = [
    "GPUS",
    "Comparison",
    "CostModel",
    "GPUSpec",
    "LinearCostModel",
    "ModelCost",
    "RooflineCostModel",
    "RunResult",
    "Simulation",
    "StepShape",
    "SyntheticSpec",
    "TraceRequest",
    "expand_policies",
    "generate",
    "get_gpu",
    "ideal_prefix_hit_tokens",
    "kv_pool_bytes",
    "load_trace",
    "parse_spec",
    "segment_tokens",
    "shared_prefix_tokens",
    "summarize",
]
