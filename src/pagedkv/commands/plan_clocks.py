"""`pagedkv plan --gpu`: the simulator's clocks the planner's time ledger reads (the planner
itself knows no GPU): one decode step per block size, and a partial prefix hit's copy against
recomputing its tokens. Imported by ``commands/plan.py`` only; the sim is imported lazily."""

from __future__ import annotations

import argparse

from pagedkv.errors import UsageError
from pagedkv.pages.backends import RULES


def decode_clock(args: argparse.Namespace, layout, workload):
    """(B -> seconds of one decode step of the workload on --gpu, the clock's name), or
    (None, None) without --gpu. A backend of pagedkv's own engine with a fitted clock
    (``pages/backends.py``: triton) is priced by its pagedkv-triton clock (CUDA graphs, as the
    engine runs decode); any other backend by the vLLM-class reference clock of the GPU."""
    if args.gpu is None:
        return None, None, None
    if args.model is None:
        raise UsageError("--gpu prices the model's layers: give --model, not --record-bytes")
    from pagedkv.sched.step_shape import StepShape

    context = max(1, round(workload.mean_len_tokens))
    batch = [(context, 1)] * workload.num_seqs
    rule = RULES.get(args.backend)
    if rule is not None and rule.engine_clock:
        from pagedkv.pages.sources import load_shape
        from pagedkv.sim.clock_presets import engine_clock_for
        from pagedkv.sim.cost_model import ModelCost
        from pagedkv.sim.gpus import get_gpu
        from pagedkv.sim.pagedkv_triton.cost import EngineCostModel

        gpu = get_gpu(args.gpu)
        clock, source = engine_clock_for(gpu)
        model = ModelCost.from_shape(load_shape(args.model), layout.kv_dtype)
        tp = args.tp  # at TP > 1 the engine captures no CUDA graphs
        engine = EngineCostModel(model, gpu, clock, tp == 1, source, tp)
        return (
            (lambda b: engine.step_time_s(StepShape.of(batch, b))),
            f"{source}, " + ("CUDA graphs" if tp == 1 else f"eager, TP {tp}"),
            engine,
        )
    from pagedkv.sim.vllm_class.cost import fitted_cost_model

    cost = fitted_cost_model(args.model, args.gpu, kv_dtype=layout.kv_dtype, tp=args.tp)
    return (lambda b: cost.step_time_s(StepShape.of(batch, b))), cost.source, cost


# The prompt tokens after the hit that its prefill computes anyway (assumed: a short turn).
_SUFFIX_TOKENS = 256


def copy_clocks(args: argparse.Namespace, cost, workload):
    """With --gpu: (bytes -> seconds of a partial hit's copy in the GPU's memory, the
    simulator's ``DeviceCopy``; (B, tokens) -> seconds to recompute those tokens instead: what
    they add to a prefill chunk of ``_SUFFIX_TOKENS`` more at the median prefix, on the same
    clock as the decode step)."""
    import statistics

    from pagedkv.sched.step_shape import StepShape
    from pagedkv.sim.gpus import get_gpu
    from pagedkv.sim.links import device_copy

    gpu = get_gpu(args.gpu)
    copier = device_copy(gpu.name, gpu.mem_bandwidth_bytes_per_s, cost.model.num_layers)
    prefixes = workload.prefix_lens_tokens
    context = int(statistics.median(prefixes)) if prefixes else 0

    def recompute_s(block_size: int, tokens: float) -> float:
        start = max(0, context - max(1, round(tokens)))  # the hit ends here instead
        more = StepShape.of([(start, context - start + _SUFFIX_TOKENS)], block_size)
        return cost.step_time_s(more) - cost.step_time_s(
            StepShape.of([(context, _SUFFIX_TOKENS)], block_size)
        )

    return copier.time_s, recompute_s
