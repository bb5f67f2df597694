"""The fused Triton kernels (issue 46 item 3) against the torch ops they replace, one process.

Four pairs at Llama-3-8B's shapes (hidden 4,096, intermediate 14,336, 32/8 heads of 128, B 16):

* ``add_rms_norm``: ``x + residual`` then ``layers.RMSNorm`` vs ``rms_norm(x, w, eps, residual)``;
* ``rms_norm``: ``layers.RMSNorm`` vs ``rms_norm(x, w, eps)``;
* ``silu_mul``: ``layers.SwiGLU``'s ``F.silu(gate).mul_(up)`` vs ``silu_mul(gate_up)``;
* ``rope_kv_write``: ``apply_rotary`` on the Q/K view + the Triton ``write_kv`` (today's
  engine path) vs ``rope_write_kv``.

Each row: equality first (max distance in ulps of every output from the torch side's, the share
of bit-equal elements, the pools compared whole), against the bounds the tests hold
(``BOUNDS``); then, on a GPU, times: ``gpu_us``, CUDA events around one call with the queue
kept busy (``gpu_check_timing.time_ms``: the GPU's own time, what a CUDA graph replays), and
``eager_us``, the wall time per call of back-to-back eager calls (what a step pays when the
host's launches are the bottleneck), medians of ``--repeats``; ``torch / fused`` ratios, and
the fused kernel's achieved GB/s. Prints a markdown table; ``--output`` also writes JSON.

    python benchmarks/bench_fused.py --output results/bench_fused.json     # a GPU (~1 minute)
    python benchmarks/bench_fused.py --dry-run    # the CPU: interpreter, tiny shapes, equality

``--dry-run`` (``tests/test_bench_fused_dry_run.py``) checks equality and exits 1 when a row is
out of bounds (on a GPU such rows are marked, not fatal); it runs the timing code once a side
so that it cannot rot, but its times are the interpreter's, not a measurement.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # Triton picks interpreter or compiler at its first import
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from common import finish_meta, machine_meta, write_json  # noqa: E402
from gpu_check_timing import time_ms  # noqa: E402
from pagedkv.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary  # noqa: E402
from pagedkv.model.projection import column_halves  # noqa: E402
from pagedkv.model.triton.kv_write import write_kv  # noqa: E402
from pagedkv.model.triton.rms_norm import rms_norm  # noqa: E402
from pagedkv.model.triton.rope_kv_write import rope_write_kv  # noqa: E402
from pagedkv.model.triton.silu_mul import silu_mul  # noqa: E402

GPU_SHAPE = {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128}
DRY_SHAPE = {"hidden": 96, "inter": 96, "heads": 4, "kv_heads": 2, "head_dim": 64}
BLOCK_SIZE, EPS = 16, 1e-5
# Max ulps from the torch side (the tests' bounds and why: tests/model/triton/test_*.py).
BOUNDS = {
    ("add_rms_norm", torch.float32): 8, ("add_rms_norm", torch.bfloat16): 2,
    ("rms_norm", torch.float32): 8, ("rms_norm", torch.bfloat16): 2,
    ("silu_mul", torch.float32): 8, ("silu_mul", torch.bfloat16): 2,
    ("rope_kv_write", torch.float32): 0, ("rope_kv_write", torch.bfloat16): 0,
}  # fmt: skip
# Compiled on a GPU, triton's fp32 exp is ex2.approx of g * log2(e): that product's rounding
# grows with |g| (~3 ulps of exp at |g| ~ 11, random gates at 4,096 tokens reach it), ex2.approx
# adds up to ~2 and torch's own CUDA expf up to 2: the interpreter's bound would flag noise.
DEVICE_BOUNDS = {("silu_mul", torch.float32): 16}


def bound_ulps(name: str, dtype: torch.dtype, device: torch.device) -> int:
    """The max ulps a fused kernel may be from its torch side on ``device``."""
    on_gpu = device.type == "cuda"
    return DEVICE_BOUNDS.get((name, dtype), BOUNDS[name, dtype]) if on_gpu else BOUNDS[name, dtype]


class _Product(nn.Module):
    """Stands in for SwiGLU's gate/up projection: its "product" is the tensor it is given."""

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return column_halves(x)


def cases(shape: dict, tokens: int, dtype: torch.dtype, device: torch.device, seed: int):
    """{name: (torch side, fused side, bytes the fused kernel moves)}; each side a function
    returning its outputs (tensors, pools last for rope). Inputs shared, pools not."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(dtype).to(device)

    hidden, inter, heads, kv_heads, dim = (shape[k] for k in GPU_SHAPE)
    elt = torch.finfo(dtype).bits // 8
    x, residual = randn(tokens, hidden), randn(tokens, hidden)
    norm = RMSNorm(hidden, EPS).to(device)
    norm.weight.data = randn(hidden)
    mlp = SwiGLU(1, inter)
    mlp.gate_up_proj = _Product()
    gate_up = randn(tokens, 2 * inter, scale=2.0)
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, 8192, (tokens,), generator=gen).to(device)
    cos, sin = RotaryEmbedding(dim, 500000.0, None).to(device).cos_sin(positions, dtype)
    num_blocks = -(-tokens // BLOCK_SIZE) + 2
    pool = randn(num_blocks, BLOCK_SIZE, kv_heads, dim)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens].to(device)
    pools = {side: (pool.clone(), pool.clone()) for side in ("torch", "fused")}
    width = (heads + kv_heads) * dim

    def torch_rope():
        qk = apply_rotary(qkv[:, :width].view(tokens, -1, dim), cos, sin)
        v = qkv[:, width:].view(tokens, kv_heads, dim)
        write_kv(qk[:, heads:], v, *pools["torch"], slots)
        return qk[:, :heads], qk[:, heads:], *pools["torch"]

    def fused_rope():
        q, k, _ = rope_write_kv(qkv, cos, sin, *pools["fused"], slots, heads)
        return q, k, *pools["fused"]

    def torch_add_norm():
        new_residual = x + residual
        return norm(new_residual), new_residual

    return {
        "add_rms_norm": (
            torch_add_norm,
            lambda: rms_norm(x, norm.weight, EPS, residual),
            4 * tokens * hidden * elt,
        ),
        "rms_norm": (lambda: (norm(x),), lambda: (rms_norm(x, norm.weight, EPS),),
                     2 * tokens * hidden * elt),
        "silu_mul": (lambda: (mlp.gated(gate_up),), lambda: (silu_mul(gate_up),),
                     3 * tokens * inter * elt),
        "rope_kv_write": (torch_rope, fused_rope,
                          tokens * (2 * heads + 5 * kv_heads) * dim * elt),
    }  # fmt: skip


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place (fp32 or bf16)."""
    int_dtype, magnitude = (
        (torch.int32, 0x7FFFFFFF) if got.dtype == torch.float32 else (torch.int16, 0x7FFF)
    )

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(int_dtype).to(torch.int64)
        return torch.where(bits < 0, -(bits & magnitude), bits)

    return (ordered(got) - ordered(want)).abs()


def compare(torch_out, fused_out) -> dict:
    """Max ulps over every output and the share of bit-equal elements."""
    distances = [ulps(f, t).flatten().cpu() for t, f in zip(torch_out, fused_out, strict=True)]
    every = torch.cat(distances)
    return {"max_ulps": int(every.max()), "equal_share": float((every == 0).double().mean())}


def eager_us(fn, device: torch.device, calls: int) -> float:
    """Wall microseconds per call of ``calls`` back-to-back calls, synchronised at both ends."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _device: None
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls * 1e6


def timings(torch_fn, fused_fn, num_bytes: int, device: torch.device, repeats: int) -> dict:
    row = {}
    for side, fn in (("torch", torch_fn), ("fused", fused_fn)):
        row[f"{side}_gpu_us"] = statistics.median(time_ms(fn, device, repeats, 3, None)) * 1e3
        row[f"{side}_eager_us"] = statistics.median(
            [eager_us(fn, device, repeats) for _ in range(5)]
        )
    row["gpu_ratio"] = row["torch_gpu_us"] / row["fused_gpu_us"]
    row["eager_ratio"] = row["torch_eager_us"] / row["fused_eager_us"]
    row["fused_gb_s"] = num_bytes / (row["fused_gpu_us"] * 1e-6) / 1e9
    return row


def interpreter_rounds_to_nearest_even() -> None:
    """The dry run only: Triton 3.9's interpreter truncates fp32 -> bf16 where a GPU rounds to
    nearest even; round through torch instead (as the tests' ``fused_support`` does)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16),
                                        tl.bfloat16)  # fmt: skip

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, equality")
    parser.add_argument("--tokens", default=None, help="token counts, e.g. 1,8,64 (GPU default "
                        "1,8,32,128,512,2048,8192; dry run 1,3)")  # fmt: skip
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, shape, default_tokens = torch.device("cpu"), DRY_SHAPE, "1,3"
        interpreter_rounds_to_nearest_even()
    elif torch.cuda.is_available():
        device, shape, default_tokens = torch.device("cuda"), GPU_SHAPE, "1,8,32,128,512,2048,8192"
    else:
        print("error: no CUDA device is visible (use --dry-run on the CPU)", file=sys.stderr)
        return 2
    meta = machine_meta(device=str(device), shape=shape, block_size=BLOCK_SIZE)
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    rows, out_of_bounds = [], 0
    print("| kernel | dtype | tokens | max ulps (bound) | bit-equal | torch / fused GPU us | "
          "ratio | torch / fused eager us | ratio | fused GB/s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for tokens in (int(t) for t in (args.tokens or default_tokens).split(",")):
            for name, (torch_fn, fused_fn, num_bytes) in cases(
                shape, tokens, dtype, device, seed=tokens
            ).items():
                row = {"kernel": name, "dtype": dtype_name, "tokens": tokens,
                       "bound_ulps": bound_ulps(name, dtype, device), **compare(torch_fn(), fused_fn())}  # fmt: skip
                row["ok"] = row["max_ulps"] <= row["bound_ulps"]
                out_of_bounds += not row["ok"]
                # the dry run times too (once), so the timing code cannot rot unseen
                repeats = args.repeats if device.type == "cuda" else 1
                row.update(timings(torch_fn, fused_fn, num_bytes, device, repeats))
                rows.append(row)
                print(markdown_row(row), flush=True)
    if args.output:
        write_json(args.output, {"meta": finish_meta(meta), "rows": rows})
    if args.dry_run:
        print("(dry run: the times are Triton's interpreter, not a measurement)")
    print(f"{len(rows)} rows, {out_of_bounds} out of bounds")
    return 1 if args.dry_run and out_of_bounds else 0


def markdown_row(row: dict) -> str:
    cells = [row["kernel"], row["dtype"], str(row["tokens"]),
             f"{row['max_ulps']} ({row['bound_ulps']}){'' if row['ok'] else ' OVER'}",
             f"{row['equal_share']:.1%}"]  # fmt: skip
    cells += [f"{row['torch_gpu_us']:.1f} / {row['fused_gpu_us']:.1f}",
              f"{row['gpu_ratio']:.2f}x",
              f"{row['torch_eager_us']:.1f} / {row['fused_eager_us']:.1f}",
              f"{row['eager_ratio']:.2f}x", f"{row['fused_gb_s']:.0f}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    sys.exit(main())
