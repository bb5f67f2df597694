"""Section ``mla`` of ``gpu_check.py`` (issue 55): the Triton MLA decode kernel
(``model/triton/mla_decode.py``) on the device.

1. correctness: against a float64 reference (latent records gathered slot by slot through each
   block table), fp32 and bf16, block sizes of ``mla_block_sizes`` and one whole reserved
   region per sequence, one pass and split-K; pass at the kernels section's tolerances;
2. bandwidth: DeepSeek's record (rank 512 + rope 64, bf16) at 16 heads (V2-Lite) and 128
   (V3), batches >= 32, contexts 1k-16k, B = 1, 16 and 64, the split count of
   ``decode_splits``' rule over ``mla_programs``: median time (CUDA events, L2 cleared) and
   GB/s of what a step must read (every context's records, the queries and outputs, the
   tables) against the device-to-device copy. Target: >= 80 % of copy bandwidth, every B
   within 15 % of the best B at each (heads, context, batch).

On the CPU (``--dry-run``) the same code at tiny sizes under Triton's interpreter."""

from __future__ import annotations

import statistics
import time

import torch

from gpu_check_kernels import TOLERANCE
from gpu_check_run import Run, attempt
from gpu_check_timing import copy_bandwidth_gb_s, time_ms
from pagedkv.model.triton.kernels import load_kernels, num_sms
from pagedkv.pages.triton_rules import mla_programs

TARGET_SHARE, SPREAD = 0.80, 0.15


def latent_pool(context_lens, block_size, width, dtype, device, gen, shuffled=True):
    """Latent records in blocks (shuffled ids, 1 spare), the tables and the lengths."""
    blocks = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks) + 1
    pool = torch.randn((num_blocks, block_size, 1, width), generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen) if shuffled else torch.arange(num_blocks)
    tables = torch.zeros((len(context_lens), max(blocks)), dtype=torch.int32)
    taken = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = order[taken : taken + n]
        taken += n
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(device) for t in (pool, tables, lens)]


def reference(q, pool, tables, lens, rank: int, scale: float) -> torch.Tensor:
    """float64 [S, H, R]: softmax((q . record) * scale) over each context, times C."""
    block_size, flat = pool.shape[1], pool.double().reshape(-1, pool.shape[-1]).cpu()
    out = torch.zeros((*q.shape[:2], rank), dtype=torch.float64)
    for s, n in enumerate(lens.tolist()):
        t = torch.arange(n)
        records = flat[tables[s].cpu().long()[t // block_size] * block_size + t % block_size]
        out[s] = ((q[s].double().cpu() @ records.t()) * scale).softmax(-1) @ records[:, :rank]
    return out


def correctness(run: Run, kernels, gen) -> list[dict]:
    rank, rope = run.sizes.mla_dims
    lens = [int(x) for x in run.sizes.mla_check_lens]
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for block_size in (*run.sizes.mla_block_sizes, max(lens)):  # the last: reserved
            for splits in (1, 3):
                pool, tables, lens_t = latent_pool(lens, block_size, rank + rope, dtype,
                                                   run.device, gen)  # fmt: skip
                q = torch.randn(len(lens), 8, rank + rope, generator=gen) / rank**0.25
                case = {"dtype": str(dtype).removeprefix("torch."), "block_size": block_size,
                        "num_splits": splits, "tolerance": TOLERANCE[dtype]}  # fmt: skip
                operands = (q.to(dtype=dtype, device=run.device), pool, tables, lens_t)
                err = attempt(case, "error", _error, kernels, operands, rank, splits)
                case.update(max_abs_error=err, ok=err is not None and err <= TOLERANCE[dtype])
                cases.append(case)
    return cases


def _error(kernels, operands, rank: int, splits: int) -> float:
    got = kernels.mla_decode(*operands, 0.1, rank, num_splits=splits)
    want = reference(*operands, rank, 0.1)
    return (got.double().cpu() - want).abs().max().item()


def bandwidth(run: Run, kernels, gen, copy_gb_s: float) -> list[dict]:
    s, device = run.sizes, run.device
    rank, rope = s.mla_dims
    rows, t0 = [], time.perf_counter()
    flush = torch.empty(s.flush_bytes, dtype=torch.uint8, device=device) if s.flush_bytes else None
    for heads in s.mla_heads:
        for context in s.mla_contexts:
            for batch in s.mla_batches:
                for block_size in s.mla_block_sizes:
                    row = {"heads": heads, "context_len": context, "batch": batch,
                           "block_size": block_size}  # fmt: skip
                    if time.perf_counter() - t0 > min(s.ledger_budget_s, run.seconds_left()):
                        rows.append({**row, "skipped": "time budget spent"})
                        continue
                    got = attempt(row, "error", _time_point, kernels, heads, context, batch,
                                  block_size, rank, rope, run, flush, gen)  # fmt: skip
                    if got is not None:
                        row.update(got, of_copy_bw=got["gb_s"] / copy_gb_s)
                    rows.append(row)
                    run.log(f"  MLA H={heads} B={block_size} context {context} batch {batch}: "
                            f"{row.get('median_ms', row.get('error'))}")  # fmt: skip
    return rows


def _time_point(kernels, heads, context, batch, block_size, rank, rope, run, flush, gen) -> dict:
    dtype, device = torch.bfloat16, run.device
    pool, tables, lens = latent_pool([context] * batch, block_size, rank + rope, dtype, device, gen)
    q = torch.randn(batch, heads, rank + rope, dtype=dtype, device=device)
    splits = kernels.decode_splits(batch, mla_programs(heads), context, num_sms(device))

    def call():
        kernels.mla_decode(q, pool, tables, lens, 0.07, rank, num_splits=splits)

    s = run.sizes
    ms = statistics.median(time_ms(call, device, s.ledger_repeats, s.ledger_warmup, flush))
    moved = batch * context * (rank + rope) * 2 + q.nbytes + batch * heads * rank * 2
    moved += tables.nbytes
    return {"num_splits": splits, "median_ms": ms, "bytes": moved, "gb_s": moved / ms / 1e6}


def summarise(rows: list[dict]) -> list[dict]:
    """Per (heads, context, batch): the best and worst B's share of copy bandwidth, and
    whether the target holds (every B >= 80 % and within 15 % of the best)."""
    points: dict[tuple, dict[str, float]] = {}  # shares by B, keyed as the JSON keeps them
    for r in rows:
        if "of_copy_bw" in r:
            point = points.setdefault((r["heads"], r["context_len"], r["batch"]), {})
            point[str(r["block_size"])] = r["of_copy_bw"]
    out = []
    for (heads, context, batch), shares in points.items():
        best, worst = max(shares.values()), min(shares.values())
        out.append({"heads": heads, "context_len": context, "batch": batch, "shares": shares,
                    "best": best, "worst": worst,
                    "target_met": worst >= TARGET_SHARE and worst >= (1 - SPREAD) * best})  # fmt: skip
    return out


def check_mla(run: Run) -> dict:
    kernels = load_kernels(run.device)
    gen = torch.Generator().manual_seed(run.args.seed)
    cases = correctness(run, kernels, gen)
    run.log(f"  MLA kernel vs float64: {sum(c['ok'] for c in cases)}/{len(cases)} pass")
    copy_gb_s = copy_bandwidth_gb_s(run.device, run.sizes.copy_bytes, run.sizes.ledger_repeats)
    rows = bandwidth(run, kernels, gen, copy_gb_s)
    rank, rope = run.sizes.mla_dims
    return {"kv_lora_rank": rank, "qk_rope_head_dim": rope, "dtype": "bfloat16",
            "copy_gb_s": copy_gb_s, "cases": cases, "all_pass": all(c["ok"] for c in cases),
            "rows": rows, "summary": summarise(rows), "target_share": TARGET_SHARE,
            "spread": SPREAD, "interpreted": kernels.interpreted}  # fmt: skip


def mla_markdown(r: dict) -> list[str]:
    """The section's summary: the correctness cases, then each point's share of copy."""
    from gpu_check_report import _table

    failed = [c for c in r["cases"] if not c["ok"]]
    out = [f"MLA decode, record {r['kv_lora_rank']} + {r['qk_rope_head_dim']} ({r['dtype']}); "
           f"vs float64: {len(r['cases']) - len(failed)}/{len(r['cases'])} pass; "
           f"device-to-device copy {r['copy_gb_s']:.0f} GB/s", ""]  # fmt: skip
    out += [f"- failed: {c}" for c in failed]
    rows = [[x["heads"], x["block_size"], x["context_len"], x["batch"], x.get("num_splits", "-"),
             f"{x['median_ms']:.3f}" if "median_ms" in x else x.get("skipped") or x.get("error"),
             f"{x['gb_s']:.0f}" if "gb_s" in x else "-",
             f"{x['of_copy_bw']:.0%}" if "of_copy_bw" in x else "-"]
            for x in r["rows"]]  # fmt: skip
    out += _table(["heads", "B", "context", "batch", "splits", "ms", "GB/s", "of copy"], rows)
    summary = [[x["heads"], x["context_len"], x["batch"], f"{x['best']:.0%}", f"{x['worst']:.0%}",
                "yes" if x["target_met"] else "no"] for x in r["summary"]]  # fmt: skip
    target = f">= {r['target_share']:.0%} of copy, every B within {r['spread']:.0%} of the best"
    return out + [
        "",
        f"target: {target}",
        "",
        *_table(["heads", "context", "batch", "best B", "worst B", "met"], summary),
    ]
