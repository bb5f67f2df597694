"""The engine section's speed parts (issue 46), each held against a measured limit of the card:

- ``batch1_latency``: one sequence (a prompt of ``batch1_prompt`` tokens, then
  ``batch1_tokens`` decode steps) on an engine with CUDA graphs and scheduling one step ahead,
  the GPU's defaults: milliseconds per output token (the decode steps of its step timeline)
  and the hidden host syncs of the whole run (``host_syncs``: 0 expected) beside the memory
  limit, the bytes a decode step must read (every weight but the embedding
  table, and the sequence's K and V at its mean context) over the measured copy bandwidth;
- ``prompt_gemms``: each of a layer's four projections at ``max_num_batched_tokens`` rows (a
  full prefill step's GEMMs), as the engine computes it (``x @ weight_t``, the weight stored
  ``[in, out]``) and as ``nn.Linear`` does (``F.linear``, ``[out, in]``: the layout cuBLAS is
  most often tuned for), beside one large square bf16 product: the card's matrix rate.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gpu_check_engine import make_engine
from gpu_check_run import Run
from gpu_check_timing import copy_bandwidth_gb_s, time_ms
from pagedkv.engine import SamplingParams
from pagedkv.engine.profiling import kv_record_bytes
from pagedkv.engine.step.timeline import StepTimeline, summarize


def decode_weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every parameter but an untied embedding
    table (a step reads only its rows); a tied one is the lm_head and counts once."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.embed_tokens is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def batch1_latency(run: Run, loaded) -> dict:
    """One sequence's decode time per token beside the memory limit (module docstring)."""
    s, (cfg, model, _) = run.sizes, loaded
    prompt_len, new_tokens = s.batch1_prompt, s.batch1_tokens
    record_bytes = kv_record_bytes(cfg, "bfloat16")
    max_model_len = prompt_len + new_tokens + 16
    engine = make_engine(loaded, "bfloat16", "triton", True, True, max_num_seqs=1,
                         max_num_batched_tokens=s.max_num_batched_tokens,
                         max_model_len=max_model_len,
                         kv_cache_memory_bytes=(max_model_len + 64) * record_bytes)  # fmt: skip
    greedy = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    prompt = [(7 * i + 11) % cfg.vocab_size for i in range(prompt_len)]
    engine.generate([prompt[::-1]], greedy)  # warm-up: the same shapes, other tokens
    timeline = StepTimeline(model.device)
    engine.attach_timeline(timeline)
    with host_syncs(model.device) as syncs:
        t0 = time.perf_counter()
        out = engine.generate([prompt], greedy)[0].outputs[0]
        seconds = time.perf_counter() - t0
    decode = [st for st in timeline.records() if st.kind == "decode"]
    if not decode:
        raise RuntimeError("the batch-1 run took no decode step")
    ms_per_token = statistics.median(st.wall_s for st in decode) * 1e3
    copy_gb_s = copy_bandwidth_gb_s(model.device, s.copy_bytes, s.ledger_repeats)
    weight_bytes = decode_weight_bytes(model)
    kv_bytes = (prompt_len + new_tokens // 2) * record_bytes
    limit_ms = (weight_bytes + kv_bytes) / (copy_gb_s * 1e9) * 1e3
    return {"prompt_tokens": prompt_len, "generated_tokens": len(out.token_ids),
            "seconds": seconds, "decode_steps": len(decode), "ms_per_token": ms_per_token,
            "mean_ms_per_token": 1e3 * sum(st.wall_s for st in decode) / len(decode),
            "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes, "copy_gb_s": copy_gb_s,
            "memory_limit_ms": limit_ms, "of_memory_limit": limit_ms / ms_per_token,
            "graph_replays": engine.parts.runner.graphs.replays,
            "host_syncs": len(syncs) if model.device.type == "cuda" else None,
            "timeline": summarize(timeline.records())}  # fmt: skip


@contextmanager
def host_syncs(device: torch.device) -> Iterator[list[str]]:
    """The synchronizing CUDA calls made inside the block (torch's sync debug mode: blocking
    copies, stream and device syncs, ``.item()``), one message each, filled when the block
    ends; none on the CPU. The step loop's one wait a step is an event's, which it does not
    count: a sync counted here is a hidden one."""
    found: list[str] = []
    if device.type != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found += [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def prompt_gemms(run: Run, loaded) -> dict:
    """A layer's projections at a full prefill step's rows, the engine's layout and
    ``nn.Linear``'s, beside the square product's rate (module docstring)."""
    s, model = run.sizes, loaded[1]
    device, rows = model.device, s.max_num_batched_tokens
    layer = model.layers[0]
    projections = {"qkv": layer.qkv_proj, "o": layer.o_proj,
                   "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(run.args.seed)

    def rate(fn, flop: float) -> dict:
        ms = statistics.median(time_ms(fn, device, s.ledger_repeats, s.ledger_warmup, None))
        return {"median_ms": ms, "tflop_s": flop / (ms / 1e3) / 1e12}

    n = s.gemm_peak_dim
    a = torch.randn(n, n, generator=gen, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=device).to(torch.bfloat16)
    peak = rate(lambda a=a, b=b: a @ b, 2.0 * n**3)
    out = {"rows": rows, "square": {"dim": n, **peak}, "projections": {}}
    for name, proj in projections.items():
        x = torch.randn(rows, proj.in_features, generator=gen, device=device).to(torch.bfloat16)
        w_out_in = proj.dense_weight().contiguous()  # nn.Linear's [out, in]
        flop = 2.0 * rows * proj.in_features * proj.out_features
        engine = rate(lambda x=x, proj=proj: proj(x), flop)
        linear = rate(lambda x=x, w=w_out_in: torch.nn.functional.linear(x, w), flop)
        out["projections"][name] = {
            "in": proj.in_features, "out": proj.out_features, "engine": engine,
            "linear": linear, "engine_over_linear": engine["tflop_s"] / linear["tflop_s"],
            "engine_of_square": engine["tflop_s"] / peak["tflop_s"],
        }  # fmt: skip
        del x, w_out_in
    return out
