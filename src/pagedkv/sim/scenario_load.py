"""One call that is "a simulate run": the twin of ``pagedkv.planner.plan.build_plan``.

    config = SimulateConfig(synthetic="requests=200,system=600", model="llama-3-8b")
    scenario = load_scenario(config)          # requests, model cost, GPU, pools, policies
    runs = scenario.run()                     # [(RunResult, summary dict), ...]
    runs = simulate(config)                   # the same in one call

``SimulateConfig`` is validated on construction (frozen; every bad value is a ``UsageError``
naming the field), so ``pagedkv simulate`` only parses flags into it and renders the results.
``load_scenario`` checks the rest (the model, the pools against the policies, the clock against
what it can price, the workload) before any replay starts; the ``Scenario`` it returns
(``sim/scenario.py``) says which clock prices each policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy
from pagedkv.pages.head_split import rank_layout
from pagedkv.pages.layout import KVLayout, layout_from_shape
from pagedkv.pages.sources import load_shape
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.compare import expand_policies
from pagedkv.sim.cost_model import CostModel, ModelCost, RooflineCostModel, kv_pool_bytes
from pagedkv.sim.gpus import GPUSpec, get_gpu
from pagedkv.sim.links import Link, get_link, host_link_for_gpu
from pagedkv.sim.pagedkv_triton.clock import EngineClock
from pagedkv.sim.scenario import Scenario
from pagedkv.sim.simulate_config import SimulateConfig
from pagedkv.sim.simulator import RunResult
from pagedkv.sim.vllm_class.clock import GPUClock
from pagedkv.traces import (
    TraceRequest,
    generate,
    load_trace,
    parse_spec,
    rescale,
    skipped_lines_note,
)


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


def load_scenario(config: SimulateConfig) -> Scenario:
    """Read or generate the requests, load the model's layout, size the pools: everything a
    run needs, checked (UsageError) before any replay starts."""
    with _as_usage_error():
        shape = load_shape(config.model)
        layout = layout_from_shape(shape, kv_dtype=config.kv_dtype)
        model = ModelCost.from_shape(shape, kv_dtype=config.kv_dtype)
        scheduler = _scheduler_config(config, model)
        policies = expand_policies(config.policies, config.block_sizes, config.prefix_match_units)
        gpu = get_gpu(config.gpu)
        pools_bytes = _pools_bytes(config, gpu, model)
        cost, gpu_clock, engine_clock = _clocks(config, model, gpu, policies)
        link = _swap_link(config, gpu)
    rank = rank_layout(layout, config.tensor_parallel, shape.num_heads)  # a GPU's KV heads
    pools_slots = _pools_slots(config, pools_bytes, rank, policies)
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


def _scheduler_config(config: SimulateConfig, model: ModelCost) -> SchedulerConfig:
    """The replicas' scheduler limits (the swap space in records of ``model``)."""
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        preemption=config.preemption,
        preemption_mode=config.preemption_mode,
        swap_space_slots=config.swap_space_bytes // model.kv_record_bytes,
    )


def _pools_bytes(config: SimulateConfig, gpu: GPUSpec, model: ModelCost) -> tuple[int, ...]:
    """The KV pool sizes to run: ``kv_memory_bytes``, else what the GPU has left."""
    tp = config.tensor_parallel  # each GPU holds 1/tp of the weights and of every token's KV
    return config.kv_memory_bytes or (
        tp
        * kv_pool_bytes(
            gpu,
            model.weight_bytes // tp,
            config.gpu_memory_utilization,
            config.activation_bytes,
        ),
    )


def _clocks(
    config: SimulateConfig, model: ModelCost, gpu: GPUSpec, policies: list[Policy]
) -> tuple[CostModel, tuple[GPUClock, str] | None, tuple[EngineClock, str] | None]:
    """The roofline or the cost profile, and the fitted clock ``config`` asks for (vLLM-class
    or pagedkv's engine, at most one); UsageError for ``cuda_graphs`` without an engine clock."""
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
    return cost, gpu_clock, engine_clock


def _swap_link(config: SimulateConfig, gpu: GPUSpec) -> Link | None:
    """The host link that prices swap transfers (swap preemption only)."""
    if config.preemption_mode != "swap":
        return None
    return get_link(config.host_link) if config.host_link else host_link_for_gpu(gpu.name)


def _pools_slots(
    config: SimulateConfig, pools_bytes: tuple[int, ...], rank: KVLayout, policies: list[Policy]
) -> tuple[int, ...]:
    """Each pool in tokens (``rank``: one GPU's record of a token, each GPU holding its share
    of the pool), checked to hold what every policy needs (UsageError)."""
    tp = config.tensor_parallel
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
    return pools_slots


def _requests(config: SimulateConfig, skipped: list[UsageError]) -> tuple[list[TraceRequest], str]:
    """The trace's requests (bad records go to ``skipped`` unless ``strict``) or the synthetic
    spec's, and where they came from, for titles."""
    if config.trace is not None:
        lenient = {} if config.strict else {"on_bad_line": skipped.append}
        requests = load_trace(config.trace, config.max_requests, config.rate_scale, **lenient)
        return requests, config.trace
    spec = parse_spec(config.synthetic or "")
    requests = rescale(generate(spec, config.seed, config.max_requests), config.rate_scale)
    return requests, f"synthetic {config.synthetic} (seed {config.seed})"


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
