"""Paged attention alone: pagedkv's one-call kernel (``native.pk_paged_attention``, every
sequence of a step read through its block table) against the torch path it replaced (decode
tokens padded together, each prompt on its own through SDPA), in one process, alternated,
medians. The shapes are the embedded SmolLM2-135M's (9 query heads, 3 KV heads, 64 dims) in one
layer's cache with blocks of 16 tokens, scattered.

On an AVX-512 CPU a third side runs the kernel with its AVX2 form forced (``native.set_isa``):
the native column is then the AVX-512 form, which prompt chunks take.

Workloads:
  prompt-N   one whole prompt of N tokens (a TTFT step's attention)
  prompts    16 prompts of 64-1,024 tokens in one step (the trace's prompt steps)
  chunk      a 256-token chunk on a cached 768-token prefix
  decode-S   S decode tokens with contexts of 200-1,200 tokens (decode-32x2k: 2,000-2,500)

Both sides' outputs are compared before anything is timed (max abs difference printed). Nothing
is asserted; docs/latency.md quotes a run.

    python benchmarks/bench_attention.py [--threads 2] [--repeats 9] [--dtype float32|bfloat16]
        [--out results/bench_attention.json]
"""

from __future__ import annotations

import argparse

import torch

from common import alternate_s, finish_meta, machine_line, machine_meta, medians, write_json
from pagedkv.model import native
from pagedkv.model.attention import AttentionPlan, paged_attention
from pagedkv.model.attention_metadata import AttentionMetadata

HQ, HKV, D, B = 9, 3, 64, 16


def workload(ctx_and_new: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """A cache holding every sequence's context in scattered blocks, its new tokens' queries,
    keys and values, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-ctx // B) for ctx, _ in ctx_and_new]
    num_blocks = sum(blocks) + 1
    k_cache = torch.randn(num_blocks, B, HKV, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, B, HKV, D, generator=gen).to(dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots = [], []
    for (ctx, new), n in zip(ctx_and_new, blocks, strict=True):
        table, order = order[:n], order[n:]
        tables.append(table + [0] * (max(blocks) - n))
        slots += [table[p // B] * B + p % B for p in range(ctx - new, ctx)]
    num_tokens = sum(new for _, new in ctx_and_new)
    starts = [0]
    for _, new in ctx_and_new:
        starts.append(starts[-1] + new)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in ctx_and_new], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    )
    qkv = [torch.randn(num_tokens, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV)]
    return (k_cache, v_cache), meta, qkv


def side(kv_cache, meta, qkv, dtype, kernels, isa: str | None = None):
    """A call of one step's attention, planning included (the engine plans once a step and
    runs 30 layers on the plan: the plan's cost is small beside 30 calls, but counted);
    ``isa``: the native kernel's form for this call, the process's own restored after."""

    def run() -> torch.Tensor:
        before = native.isa()
        if isa is not None:
            native.set_isa(isa)
        try:
            plan = AttentionPlan(meta, B, dtype, kernels=kernels)
            return paged_attention(*qkv, kv_cache, plan, D**-0.5)
        finally:
            native.set_isa(before)

    return run


WORKLOADS = {
    "prompt-256": [(256, 256)],
    "prompt-1024": [(1024, 1024)],
    "prompts": [
        (n, n)
        for n in (64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 896, 1024)
    ],  # fmt: skip
    "chunk": [(1024, 256)],
    "decode-16": [(200 + 63 * i, 1) for i in range(16)],
    "decode-64": [(200 + 16 * i, 1) for i in range(64)],
    "decode-32x2k": [(2000 + 16 * i, 1) for i in range(32)],  # from DRAM: 100 MB a layer
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = native.kernels()
    if lib is None:
        raise SystemExit(f"error: native kernels unavailable: {native.unavailable_reason()}")
    dtype = getattr(torch, args.dtype)
    meta = machine_meta(threads=args.threads, dtype=args.dtype, repeats=args.repeats)
    print(machine_line(meta))
    wide = native.isa() == "avx512"
    print(
        f"native form: {native.isa()}"
        + (" (P V of every item, scores of prompt chunks), avx2 forced beside it" if wide else "")
    )
    print("| workload | native ms | torch ms | native faster |"
          + (" avx2 ms | avx512 faster |" if wide else "") + " max abs diff |")  # fmt: skip
    rows = {}
    for name, shape in WORKLOADS.items():
        kv_cache, step, qkv = workload(shape, dtype)
        fns = {"native": side(kv_cache, step, qkv, dtype, lib),
               "torch": side(kv_cache, step, qkv, dtype, None)}  # fmt: skip
        if wide:
            fns["native-avx2"] = side(kv_cache, step, qkv, dtype, lib, "avx2")
            assert torch.equal(fns["native"](), fns["native-avx2"]()), "the forms' bits differ"
        diff = float((fns["native"]().float() - fns["torch"]().float()).abs().max())
        med = medians(alternate_s(fns, args.repeats))
        rows[name] = {**{f"{k}_s": v for k, v in med.items()}, "max_abs_diff": diff}
        line = (f"| {name} | {med['native'] * 1e3:.2f} | {med['torch'] * 1e3:.2f} | "
                f"{med['torch'] / med['native']:.2f}x |")  # fmt: skip
        if wide:
            avx2 = med["native-avx2"]
            line += f" {avx2 * 1e3:.2f} | {avx2 / med['native']:.2f}x |"
        print(f"{line} {diff:.1e} |")
    if args.out:
        write_json(args.out, {"meta": finish_meta(meta), "workloads": rows})


if __name__ == "__main__":
    main()
