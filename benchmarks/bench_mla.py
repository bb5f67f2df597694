"""MLA on the CPU (issue 55): a decode step of a DeepSeek-V2-Lite-shaped model (random fp32
weights: its hidden size 2048, 16 heads of 128 + 64 rope dims and 128 value dims, latent rank
512, 64 experts of 1,408 (6 a token) and 2 shared, the first layer dense of 10,944; ``--layers``
of its 27, a 32k vocabulary) with every sequence's context already in the paged latent pool.

Sides, alternated with their order flipped every round, medians:

* ``absorbed``: the engine's decode on the native backend (``mla/native.py``: queries into
  latent space, pagedkv's C paged-attention kernel reading the latent pool in place as MQA,
  the output through W_UV);
* ``absorbed_torch``: the same math on torch ops (``mla/paged.py``: the records gathered
  through the plan, two batched products), the torch-sdpa backend's;
* ``decompressed``: the same step with each layer's attention decompressing every context
  latent into per-head K and V (``latent.decompress``) and attending over them, what an
  engine without absorption does at decode.

Timed twice, in this process's CPU seconds (``--threads 1`` keeps them the work's own on a
shared machine): the whole decode step (``model.forward``), and one layer's attention op alone.
The absorbed op's read rate (the latent bytes of the contexts per second) and its GFLOP/s are
printed beside pagedkv's native MHA kernel reading K/V of the same bytes (a GQA cache of 8
heads of 128), alternated with them: the MHA path's standard on this machine. (Absorbed MLA does
~15 flops per byte of the pool where GQA decode does ~2: on a CPU it is compute-bound.) Then capacity: the engine's
start-up section 1 (``engine/pool_plan.plan_pool``) sizes a ``--kv-cache-memory`` pool for the
DeepSeek-V2-Lite and Llama-3-8B presets in bf16: the tokens each holds. Nothing is asserted.

    python benchmarks/bench_mla.py [--contexts 1024,4096] [--batch 1] [--layers 2]
        [--repeats 5] [--threads 1] [--kv-cache-memory 1GiB] [--out results/bench_mla.json]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench_mla_parts import capacity, mha_same_bytes, mla_model, step_inputs
from common import alternate_s, finish_meta, machine_line, machine_meta, medians, write_json
from pagedkv.model.attention import _read_decode
from pagedkv.model.mla.latent import decompress
from pagedkv.model.torch_backend import TorchStep

# This process's CPU time: on the shared 2-core machine other jobs' load stretches the wall
# clock of a one-thread run but not its CPU seconds (``common.seconds``).
CLOCK = time.process_time


class DecompressedStep(TorchStep):
    """The native step with MLA's decode rows decompressed: each sequence's context latents
    (gathered through the plan as the absorbed path gathers them) through ``kv_b_proj`` into
    per-head K and V (``latent.decompress``), then SDPA over them. Decode-only steps of equal
    contexts (the benchmark's)."""

    def mla_attend(self, q, records, kv_cache, latent, scale):
        plan, (pool,) = self.plan, kv_cache
        pool.view(-1, pool.shape[-1]).index_copy_(0, plan.slot_mapping, records)
        contexts = _read_decode(pool, plan.decode, plan, "latent")[:, :, 0]  # [S, L, R + Dr]
        rows = []
        for s in range(q.shape[0]):
            keys, values = decompress(contexts[s], latent)  # [L, H, Dq], [L, H, Dv]
            attn = F.scaled_dot_product_attention(
                q[s, :, None], keys.transpose(0, 1), values.transpose(0, 1), scale=scale
            )
            rows.append(attn.reshape(-1))  # [H * Dv]
        return torch.stack(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2, help="of DeepSeek-V2-Lite's 27 (2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="1GiB", help="the capacity pool (1GiB)")
    p.add_argument("--out", default="results/bench_mla.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    meta = machine_meta(threads=args.threads, batch=args.batch, layers=args.layers)
    print(machine_line(meta))
    # Before the model takes its memory: start-up refuses a pool the machine has no room for.
    results: dict = {"capacity": capacity(args.kv_cache_memory)}
    model = mla_model(args.layers)
    results.update(decode_step=[], attention_op=[])
    for context in (int(c) for c in args.contexts.split(",")):
        inputs = step_inputs(model, args.batch, context)
        results["decode_step"].append(time_step(model, inputs, context, args))
        results["attention_op"].append(time_op(model, inputs, context, args))
    for line in report_lines(results):
        print(line)
    write_json(args.out, {"meta": finish_meta(meta), **results})
    print(f"written to {args.out}")


def _steps(model, inputs):
    """The engine's native step (the C kernel over the latent pool), the same absorbed math
    on torch ops (records gathered through the plan, two batched products), decompressed."""
    absorbed = model.default_backend().plan(inputs.meta, inputs.kv, inputs.block_size)
    return {
        "absorbed": absorbed,
        "absorbed_torch": TorchStep(absorbed.plan),
        "decompressed": DecompressedStep(absorbed.plan),
    }


def time_step(model, inputs, context: int, args) -> dict:
    """The whole decode step, both sides (their outputs compared first)."""
    steps = _steps(model, inputs)

    def forward(step):
        return model(inputs.ids, inputs.positions, inputs.kv, inputs.meta, inputs.block_size, step)

    out = {name: forward(step) for name, step in steps.items()}
    diff = max((out["absorbed"] - o).abs().max().item() for o in out.values())
    sides = {n: (lambda s=s: forward(s)) for n, s in steps.items()}
    med = medians(alternate_s(sides, args.repeats, clock=CLOCK))
    return {"context": context, "batch": args.batch, "layers": args.layers,
            "max_abs_diff": diff, "median_s": med,
            "decompressed_over_absorbed": med["decompressed"] / med["absorbed"],
            "torch_over_absorbed": med["absorbed_torch"] / med["absorbed"]}  # fmt: skip


def time_op(model, inputs, context: int, args) -> dict:
    """Layer 0's attention op alone (this step's queries and records), both sides, and the
    native MHA kernel reading the same bytes, alternated."""
    steps = _steps(model, inputs)
    q, records = inputs.layer0_q, inputs.layer0_records
    latent, scale = inputs.latent, inputs.scale
    latent_bytes = args.batch * context * inputs.kv[0][0].shape[-1] * 4
    mha, mha_bytes, mha_context = mha_same_bytes(args.batch, latent_bytes)

    def attend(step):
        return step.mla_attend(q, records, inputs.kv[0], latent, scale)

    sides = {n: (lambda s=s: attend(s)) for n, s in steps.items()}
    med = medians(alternate_s({**sides, "mha_native": mha}, args.repeats, clock=CLOCK))
    dims = latent.dims  # multiply-adds of the absorbed op: scores and the weighted sum
    flop = 2 * args.batch * context * dims.num_heads * (dims.record_width + dims.kv_lora_rank)
    return {"context": context, "batch": args.batch, "median_s": med,
            "latent_bytes": latent_bytes, "absorbed_gb_s": latent_bytes / med["absorbed"] / 1e9,
            "absorbed_gflop_s": flop / med["absorbed"] / 1e9,
            "mha_context": mha_context, "mha_gb_s": mha_bytes / med["mha_native"] / 1e9,
            "decompressed_over_absorbed": med["decompressed"] / med["absorbed"],
            "torch_over_absorbed": med["absorbed_torch"] / med["absorbed"]}  # fmt: skip


def report_lines(results: dict) -> list[str]:
    lines = ["decode step (absorbed vs decompressed attention):"]
    for r in results["decode_step"]:
        m = r["median_s"]
        lines.append(f"  context {r['context']:>6} batch {r['batch']}: absorbed "
                     f"{m['absorbed'] * 1e3:8.1f} ms (torch ops {m['absorbed_torch'] * 1e3:.1f}),"
                     f" decompressed {m['decompressed'] * 1e3:8.1f} ms "
                     f"({r['decompressed_over_absorbed']:.1f}x), max |diff| "
                     f"{r['max_abs_diff']:.1e}")  # fmt: skip
    lines.append("one layer's attention op:")
    for r in results["attention_op"]:
        m = r["median_s"]
        lines.append(f"  context {r['context']:>6}: absorbed {m['absorbed'] * 1e3:7.2f} ms "
                     f"({r['absorbed_gb_s']:.1f} GB/s of latents, {r['absorbed_gflop_s']:.0f} "
                     f"GFLOP/s; torch ops {m['absorbed_torch'] * 1e3:.2f} ms), "
                     f"decompressed {m['decompressed'] * 1e3:7.2f} ms "
                     f"({r['decompressed_over_absorbed']:.0f}x); native MHA kernel on the same "
                     f"bytes: {m['mha_native'] * 1e3:.2f} ms, {r['mha_gb_s']:.1f} GB/s")  # fmt: skip
    lines.append(f"capacity of one {results['capacity']['pool']} pool (engine start-up):")
    for name, c in results["capacity"]["models"].items():
        lines.append(f"  {name:<18} {c['record_bytes']:>7} B/token -> {c['tokens']:>9,} tokens")
    return lines


if __name__ == "__main__":
    main()
