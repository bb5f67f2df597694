"""The device check of pagedkv's GPU path (issue 24): one command, one call on a lent H200.

Sections (each timed and caught: a failing one records its error and the next one runs):

1. ``kernels``: every Triton kernel against a float64 torch reference on the device: paged
   decode (one pass and split-K), paged prefill (cached prefix, ragged batch, a decode row),
   KV write (slot -1 skipped), block copy; fp32 and bf16, block sizes 1, 3, 16, 64 and 2048,
   GQA 4, head dim 128; max abs error, pass at 1e-4 (fp32) / 3e-2 (bf16); and the fused
   kernels of the Triton layer (RMSNorm, add + RMSNorm, SiLU * up, RoPE + KV write) against
   the torch ops they replace, in ulps within the tests' bounds.
2. ``greedy``: greedy tokens of SmolLM2-135M in fp32 (8 prompts x 32 tokens): pagedkv on the
   GPU (Triton, eager and CUDA graphs) and transformers on the GPU, each against pagedkv's CPU
   path; identical sequences and the first divergence. The embedded GGUF when installed, else
   its first 6 layers from wheels/ (the whole file, 94 MiB, exceeds the device transfer).
3. ``service``: ``pagedkv serve --device cuda`` as real processes driven over HTTP
   (``gpu_check_service.py``): chat, stream, n = 4, cached tokens on a repeated system prompt,
   logprobs + echo, a JSON schema, ``/metrics``; a prefill/decode pair on one redis-server
   (each sizing its pool from the card), a mismatched block size refused and one re-paged; swap
   and a host tier on a 40-block pool; a router over two replicas; no blocks in use after.
4. ``ledger``: decode-attention time (CUDA events, median of 20, L2 cleared) and bandwidth at
   Llama-3-8B's attention shape (32/8 heads of 128, bf16) over block sizes 1-256, contexts
   1k-32k and batches 1-256, with decode_splits' split count and with one pass, beside the
   measured device-to-device copy bandwidth; the same kernel on a contiguous layout (one
   block per sequence, the identity table) at every (context, batch), so paging's cost is
   paged / contiguous; and prefill attention's TFLOP/s over context lengths beside torch's
   fused attention on the same shapes.
4b. ``mla``: the Triton MLA decode kernel (issue 55, ``gpu_check_mla.py``): against float64
   (fp32 and bf16, B = 1, 16, 64 and a reserved region, one pass and split-K), then its
   bandwidth at DeepSeek's record (rank 512 + rope 64, bf16; 16 and 128 heads) at batches >= 32,
   contexts 1k-16k, B = 1, 16, 64, against the device-to-device copy (target >= 80 %, every B
   within 15 % of the best).
5. ``engine``: a Llama-3-8B-shaped model with random bf16 weights made on the GPU; 256 Azure
   conversation requests at t = 0 (prompts <= 2048, outputs <= 256 tokens, EOS ignored):
   pagedkv's output tok/s eager and with CUDA graphs (both synchronous, as issue 24's check ran
   them) and with graphs and scheduling one step ahead (the GPU's default), each after a warm-up
   that compiles its kernels and with its step timeline (``engine/step/timeline.py``: host phases
   and the forward's GPU time per kind of step), beside transformers ``generate`` on the
   same tensors (static left-padded batches of 64, greedy, no batch begun that would end past 30 s); batch-1 decode
   (a 2,048-token prompt, 64 tokens) against the memory limit, and a layer's prompt GEMMs at
   8,192 rows against ``F.linear`` and the square bf16 rate (``gpu_check_speed.py``); then an
   engine with default settings on it (the pool sized from the card), its pool's size recorded.
6. ``profile_sim``: ``pagedkv profile``'s ``measure`` (a small grid) on that model writes a
   cost profile (beside --output); the simulator replays section 4's eager run on it.
7. ``clock`` (last): graph-replayed and more eager steps, the engine section's runs again warm with every
   step timed, then the clock of pagedkv's engine fitted from the check's own sections and the
   simulator's error on its own engine runs (``gpu_check_clock.py``; issue 47).

The one call on the device machine, after ``bash benchmarks/gpu_wheels.sh`` here (the device
tool's ``run`` with carry ["wheels"]; what is under $OUT comes back, even from a cut call)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \\
      --find-links wheels -r wheels/requirements.txt && export PYTHONPATH=/tmp/site:src \\
      PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_check.py --output $OUT/gpu_check.json \\
      2> >(tee $OUT/gpu_check.err >&2) >/dev/null

on the kind ``nvidia-h200`` (an H100's 80 GB cannot hold the engine and clock sections). The
JSON and its markdown summary (``$OUT/gpu_check.md``) are rewritten after every section, so a
call cut short keeps what finished; the progress log goes to ``$OUT/gpu_check.err``.

The fused kernels' timings (RMSNorm + residual, RoPE + KV write, SiLU x up against their torch
forms) are a separate benchmark for the same call: ``python3 benchmarks/bench_fused.py
--output $OUT/bench_fused.json``.

About 8 minutes there (a section that would end past --deadline-s, 540 s, is skipped). ``--dry-run``: the
same code on this CPU under Triton's interpreter at tiny sizes (a 2-layer copy of the embedded
GGUF, a tiny random llama for sections 4-5), under a minute: what keeps this script from
rotting (``tests/test_gpu_check_dry_run.py``). Both write --output (JSON, rewritten after each
section) and print a markdown summary on stdout; progress goes to stderr.
"""

from __future__ import annotations

import os
import sys

# Triton picks interpreter or compiler at its first import (transformers imports it too).
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from common import finish_meta, machine_meta, write_json, write_text  # noqa: E402
from gpu_check_clock import check_clock  # noqa: E402
from gpu_check_engine import (  # noqa: E402
    ENGINE_RUNS,
    GREEDY_TEXTS,
    default_pool,
    engine_model,
    engine_workload,
    first_divergence,
    greedy_model,
    hf_greedy,
    hf_throughput,
    pagedkv_greedy,
    pagedkv_throughput,
)
from gpu_check_kernels import (  # noqa: E402
    KERNEL_HEADS,
    TOLERANCE,
    fused_cases,
    kernel_cases,
)
from gpu_check_mla import check_mla  # noqa: E402
from gpu_check_profile import check_profile_sim  # noqa: E402
from gpu_check_report import summary_markdown, versions  # noqa: E402
from gpu_check_run import DEVICE_SIZES, DRY_SIZES, GIB, SMALL_GGUF, TRACE, Run, attempt  # noqa: E402
from gpu_check_service import check_service  # noqa: E402
from gpu_check_speed import batch1_latency, prompt_gemms  # noqa: E402
from gpu_check_timing import copy_bandwidth_gb_s, decode_times, prefill_times  # noqa: E402
from pagedkv.model.triton.kernels import load_kernels  # noqa: E402
from pagedkv.pages.triton_rules import block_size_problems, kv_tile  # noqa: E402

# -- 1. kernels -----------------------------------------------------------------------------------


def check_kernels(run: Run) -> dict:
    """Each kernel against its torch reference, per dtype and block size."""
    kernels = load_kernels(run.device)
    gen = torch.Generator().manual_seed(run.args.seed)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        tolerance = TOLERANCE[dtype]
        for block_size in run.sizes.kernel_block_sizes:
            for kernel, error_of in kernel_cases(kernels, block_size, dtype, run.device, gen,
                                                 run.args.dry_run):  # fmt: skip
                case = {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."),
                        "block_size": block_size, "tolerance": tolerance}  # fmt: skip
                err = attempt(case, "error", error_of)
                case.update(max_abs_error=err, ok=err is not None and err <= tolerance)
                cases.append(case)
                run.log(f"  {kernel} {case['dtype']} B={block_size}: {err}")
    fused = fused_cases(run.device, run.args.dry_run, run.args.seed)
    run.log(f"  fused kernels: {sum(f['ok'] for f in fused)}/{len(fused)} within bounds")
    q_heads, kv_heads, head_dim = KERNEL_HEADS
    return {"num_q_heads": q_heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "cases": cases, "fused": fused,
            "all_pass": all(c["ok"] for c in cases + fused),
            "interpreted": kernels.interpreted}  # fmt: skip


# -- 2. greedy ------------------------------------------------------------------------------------


def check_greedy(run: Run) -> dict:
    """Greedy tokens on the device (pagedkv Triton eager and graphs, pagedkv's torch SDPA
    path, transformers) against
    pagedkv's CPU path (its C kernels), all fp32, the same prompt ids."""
    from pagedkv.model import load_model, native

    path, source = greedy_model(run)
    n, new_tokens = run.sizes.greedy_prompts, run.sizes.greedy_tokens
    loaded = load_model(path, "float32", progress=False, device=run.device)
    prompts = [loaded[2].encode(text) for text in GREEDY_TEXTS[:n]]
    tokens, errors = {}, {}
    for graphs in (False, True):  # synchronous eager, and the GPU's default engine
        label = "pagedkv triton" + (" + cuda graphs + async" if graphs else "")
        tokens[label] = attempt(errors, label, pagedkv_greedy, loaded, prompts, new_tokens,
                                "triton", graphs, graphs)  # fmt: skip
        run.log(f"  {label}: {errors.get(label, 'done')}")
    # The reference path on the device too: torch SDPA over K/V gathered by the plan.
    label = "pagedkv torch sdpa"
    tokens[label] = attempt(errors, label, pagedkv_greedy, loaded, prompts, new_tokens, "torch",
                            False)  # fmt: skip
    del loaded
    cpu = load_model(path, "float32", progress=False, device="cpu")
    tokens["pagedkv cpu"] = pagedkv_greedy(cpu, prompts, new_tokens, "torch", False)
    del cpu
    tokens["transformers"] = attempt(errors, "transformers", hf_greedy, path, run.device, prompts,
                                     new_tokens)  # fmt: skip
    comparisons, reference = {}, tokens["pagedkv cpu"]
    for name, seqs in tokens.items():
        if name != "pagedkv cpu" and seqs is not None:
            where = [first_divergence(a, b) for a, b in zip(seqs, reference, strict=True)]
            comparisons[name] = {"identical": where.count(None), "first_divergence": where}
    return {"model": source, "prompts": n, "tokens_per_prompt": new_tokens,
            "reference": "pagedkv cpu", "comparisons": comparisons, "errors": errors,
            "cpu_c_kernels": native.unavailable_reason() or "loaded",
            "tokens": tokens}  # fmt: skip


# -- 4. ledger ------------------------------------------------------------------------------------


def check_ledger(run: Run) -> dict:
    """Decode attention's time and bandwidth over block sizes, contexts and batches, paged and
    contiguous; prefill attention's TFLOP/s."""
    s, device = run.sizes, run.device
    kernels = load_kernels(device)
    num_q_heads, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    token_bytes = 2 * num_kv_heads * head_dim * 2  # K and V of one token, one layer, bf16
    copy_gb_s = copy_bandwidth_gb_s(device, s.copy_bytes, s.ledger_repeats)
    run.log(f"  device-to-device copy: {copy_gb_s:.0f} GB/s")
    # Block size None: the contiguous layout (one block of the context per sequence).
    points = [(c, n, b) for c in s.ledger_contexts for n in s.ledger_batches
              for b in (*s.ledger_block_sizes, None)]  # fmt: skip

    def pool_tokens(c: int, n: int, b: int | None) -> int:
        return n * c if b is None else n * -(-c // b) * b

    runnable = [p for p in points if not block_size_problems(p[2] or p[0], head_dim)
                and pool_tokens(*p) * token_bytes <= s.ledger_pool_bytes]  # fmt: skip
    # One pool for every point (each views its first blocks): allocated and filled once.
    max_tokens = max((pool_tokens(*p) for p in runnable), default=0)
    k_flat = torch.empty(max_tokens, num_kv_heads, head_dim, dtype=dtype, device=device).normal_()
    v_flat = torch.empty_like(k_flat).normal_()
    flush = torch.empty(s.flush_bytes, dtype=torch.uint8, device=device) if s.flush_bytes else None
    rows, t0 = [], time.perf_counter()
    budget_s = min(s.ledger_budget_s, run.seconds_left())
    for c, n, b in points:
        row = {"block_size": b or c, "context_len": c, "batch": n,
               "layout": "paged" if b else "contiguous"}  # fmt: skip
        if problems := block_size_problems(b or c, head_dim):
            rows.append({**row, "refused": problems})
        elif (c, n, b) not in runnable:
            rows.append({**row, "skipped": f"pool over {s.ledger_pool_bytes / GIB:.0f} GiB"})
        elif time.perf_counter() - t0 > budget_s:
            rows.append({**row, "skipped": "ledger time budget spent"})
        else:
            timed = attempt(row, "error", decode_times, kernels, k_flat, v_flat, c, n, b or c,
                            num_q_heads, s.ledger_repeats, s.ledger_warmup, flush,
                            b is None)  # fmt: skip
            if timed is None:  # its error is in the row
                rows.append(row)
            else:
                rows += [{**row, **t, "of_copy_bw": t["gb_s"] / copy_gb_s} for t in timed]
            run.log(f"  B={row['block_size']} context {c} batch {n}: "
                    f"{rows[-1].get('median_ms', row.get('error'))}")  # fmt: skip
    del k_flat, v_flat
    run.free_memory()
    prefill, errors = [], {}
    for c in s.prefill_contexts:
        got = attempt(errors, f"prefill {c}", prefill_times, kernels, c, 16,
                      (num_q_heads, num_kv_heads, head_dim), dtype, device, s.ledger_repeats,
                      s.ledger_warmup)  # fmt: skip
        if got is not None:
            prefill.append(got)
            run.log(f"  prefill {c}: {got['pagedkv']['tflop_s']:.1f} TFLOP/s, "
                    f"SDPA {got['torch_sdpa']['tflop_s']:.1f}")  # fmt: skip
    return {"shape": {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads,
                      "head_dim": head_dim, "dtype": "bfloat16"},
            "tile_tokens": kv_tile(head_dim, 2), "copy_gb_s": copy_gb_s, "rows": rows,
            "paged_over_contiguous": paged_over_contiguous(rows), "prefill": prefill,
            "prefill_errors": errors}  # fmt: skip


def paged_over_contiguous(rows: list[dict]) -> list[dict]:
    """Per (block size, context, batch): the rule's paged time over the contiguous layout's
    at the same (context, batch), the second article's "the kernel costs only a few
    percent" as a measured number."""
    timed = [r for r in rows if r.get("variant") == "rule"]
    base = {(r["context_len"], r["batch"]): r["median_ms"] for r in timed
            if r["layout"] == "contiguous"}  # fmt: skip
    return [{"block_size": r["block_size"], "context_len": r["context_len"],
             "batch": r["batch"], "ratio": r["median_ms"] / base[(r["context_len"], r["batch"])]}
            for r in timed if r["layout"] == "paged"
            and (r["context_len"], r["batch"]) in base]  # fmt: skip


# -- 5. engine ------------------------------------------------------------------------------------


def check_engine(run: Run) -> dict:
    """pagedkv (``ENGINE_RUNS``: synchronous eager and CUDA graphs, and the GPU's default,
    graphs with scheduling one step ahead) beside transformers on one trace workload; batch-1
    decode and the prompt GEMMs against the card's limits; the default pool."""
    s = run.sizes
    loaded, weights = engine_model(run)
    ids, outs = engine_workload(run, loaded[0].vocab_size)
    result = {"model": s.engine_model, "requests": len(ids), "prompt_tokens": sum(map(len, ids)),
              "output_tokens": sum(outs), "pagedkv": {}, "errors": {}}  # fmt: skip
    errors, tokens = result["errors"], {}
    for label, (graphs, ahead) in ENGINE_RUNS.items():
        row = attempt(errors, label, pagedkv_throughput, run, loaded, ids, outs, graphs, ahead)
        run.free_memory()
        if row is not None:
            tokens[label] = row.pop("_tokens")
            result["pagedkv"][label] = row
        run.log(f"  pagedkv {label}: {errors.get(label) or row['tokens_per_s']} tok/s")
    if "eager" in tokens:  # bf16: graphs pad batches, so a GEMM may round differently
        result["same_tokens_as_eager"] = {
            k: sum(a == b for a, b in zip(v, tokens["eager"], strict=True)) / len(v)
            for k, v in tokens.items() if k != "eager"}  # fmt: skip
    if "cuda_graphs" in tokens and "cuda_graphs_async" in tokens:  # the same shapes: equal
        pairs = zip(tokens["cuda_graphs_async"], tokens["cuda_graphs"], strict=True)
        result["async_same_tokens"] = sum(a == b for a, b in pairs) / len(tokens["cuda_graphs"])
    hf = attempt(errors, "transformers", hf_throughput, loaded[0], weights, ids, outs, run)
    del weights
    run.free_memory()
    result["batch1"] = attempt(errors, "batch1", batch1_latency, run, loaded)
    run.free_memory()
    result["prompt_gemms"] = attempt(errors, "prompt_gemms", prompt_gemms, run, loaded)
    run.free_memory()
    result["default_pool"] = attempt(errors, "default_pool", default_pool, run, loaded)
    if hf is not None:
        result["transformers"] = hf
        run.log(f"  transformers generate: {hf['tokens_per_s']:.0f} tok/s")
    rates = {k: v["tokens_per_s"] for k, v in result["pagedkv"].items()}
    if hf is not None:
        result["ratio_vs_transformers"] = {k: r / hf["tokens_per_s"] for k, r in rates.items()}
    if "eager" in rates and "cuda_graphs" in rates:
        result["cuda_graphs_speedup"] = rates["cuda_graphs"] / rates["eager"]
    if "cuda_graphs" in rates and "cuda_graphs_async" in rates:
        result["async_speedup"] = rates["cuda_graphs_async"] / rates["cuda_graphs"]
    return result


SECTIONS = {"kernels": check_kernels, "greedy": check_greedy, "service": check_service,
            "ledger": check_ledger, "mla": check_mla, "engine": check_engine,
            "profile_sim": check_profile_sim, "clock": check_clock}  # fmt: skip


# -- the run --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU under Triton's interpreter, tiny sizes (the test's run)")  # fmt: skip
    p.add_argument("--output", default="results/gpu_check.json", help="JSON (%(default)s)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated, run in the order given (default: %(default)s)")  # fmt: skip
    p.add_argument("--trace", help=f"Azure conversation CSV (default: the shared {TRACE}, "
                   "else wheels/traces/, which gpu_wheels.sh fills)")  # fmt: skip
    p.add_argument("--greedy-gguf", help="the greedy section's GGUF (default: the embedded "
                   f"model, else wheels/{SMALL_GGUF})")  # fmt: skip
    p.add_argument("--engine-requests", type=int, help="section 4's requests (device: 256)")
    p.add_argument("--deadline-s", type=float, default=540.0,
                   help="the check ends by then: a section that would end later (by its likely "
                   "time on an H200) is skipped (%(default)s s)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if unknown := set(args.sections.split(",")) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args


def run_section(name: str, run: Run, results: dict) -> None:
    """One section, timed; an exception is recorded (message and traceback) and swallowed."""
    run.log(f"section {name}: start")
    t0 = time.perf_counter()
    entry: dict = {"ok": False, "error": None}
    try:
        entry["result"] = SECTIONS[name](run)
        entry["ok"] = True
    except Exception as exc:  # one failing section must not lose the others
        entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["traceback"] = traceback.format_exc()
        run.log(f"section {name}: FAILED {entry['error']}")
    run.free_memory()
    entry["wall_s"] = round(time.perf_counter() - t0, 2)
    results["sections"][name] = entry
    run.log(f"section {name}: {entry['wall_s']} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (--dry-run runs on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    started = time.perf_counter()
    markdown_path = Path(args.output).with_suffix(".md")
    results = {"meta": machine_meta(
        dry_run=args.dry_run, argv=sys.argv[1:], versions=versions(),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
    ), "sections": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        run = Run(args, DRY_SIZES if args.dry_run else DEVICE_SIZES, device, Path(scratch),
                  started)  # fmt: skip
        if device.type == "cuda" and (total := torch.cuda.mem_get_info(device)[1]) < 120 * GIB:
            run.log(f"warning: {total / GIB:.0f} GiB on this card; the engine and clock sections "
                    "are sized for an H200's 141 GB (the device tool's kind nvidia-h200)")  # fmt: skip
        for name in args.sections.split(","):
            expected = run.sizes.section_s.get(name, 0.0)
            if expected > run.seconds_left():
                results["sections"][name] = {"ok": False, "wall_s": 0.0, "error": (
                    f"skipped: its likely {expected:.0f} s would end past --deadline-s "
                    f"({run.seconds_left():.0f} s left)")}  # fmt: skip
                run.log(f"section {name}: {results['sections'][name]['error']}")
            else:
                run_section(name, run, results)
            # after every section: a call cut short keeps the JSON and the summary so far
            write_json(args.output, results)
            write_text(markdown_path, summary_markdown(results))
        run.state.clear()
    finish_meta(results["meta"])
    results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(args.output, results)
    summary = summary_markdown(results)
    write_text(markdown_path, summary)
    print(summary)
    run.log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
