"""The record and the summary of a device check: the versions a run depends on, and the run as
markdown (a header per section, then its table)."""

from __future__ import annotations

import torch

# -- the record and the summary -------------------------------------------------------------------


def versions() -> dict:
    """The versions a device run depends on (None: not installed)."""
    import importlib.metadata as md

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("triton", "transformers", "tokenizers", "gguf", "accelerate"):
        try:
            out[package] = md.version(package)
        except md.PackageNotFoundError:
            out[package] = None
    return out


def summary_markdown(results: dict) -> str:
    """The run as markdown: a header per section (its error when it failed), then its table."""
    meta, v = results["meta"], results["meta"]["versions"]
    lines = [
        f"# gpu_check on {meta['device_name']}" + (" (dry run)" if meta["dry_run"] else ""),
        "",
        f"{meta['started_utc']}, torch {v['torch']} (CUDA {v['cuda']}), triton {v['triton']}, "
        f"transformers {v['transformers']}; load {meta['load_avg_before']}; "
        f"{meta.get('wall_s', '?')} s in all",
    ]
    for name, entry in results["sections"].items():
        lines += ["", f"## {name} ({entry['wall_s']} s)", ""]
        if not entry["ok"]:
            lines.append(f"error: {entry['error']}")
            continue
        lines += _RENDER[name](entry["result"])
    return "\n".join(lines)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _kernels(r: dict) -> list[str]:
    passed = sum(c["ok"] for c in r["cases"])
    rows = [[c["kernel"], c["dtype"], c["block_size"],
             c.get("error") or f"{c['max_abs_error']:.2e}", f"{c['tolerance']:g}",
             "ok" if c["ok"] else "**FAIL**"] for c in r["cases"]]  # fmt: skip
    fused = r.get("fused", [])
    fused_rows = [[f["kernel"], f["dtype"], f["tokens"], f.get("error") or f["max_ulps"],
                   f["bound_ulps"], "ok" if f["ok"] else "**FAIL**"] for f in fused]  # fmt: skip
    return [f"{passed}/{len(rows)} cases pass (GQA {r['num_q_heads']}/{r['num_kv_heads']}, "
            f"head dim {r['head_dim']})", "",
            *_table(["kernel", "dtype", "B", "max abs error", "tolerance", ""], rows),
            "", f"fused kernels: {sum(f['ok'] for f in fused)}/{len(fused)} within bounds", "",
            *_table(["kernel", "dtype", "tokens", "max ulps", "bound", ""], fused_rows)]  # fmt: skip


def _greedy(r: dict) -> list[str]:
    rows = [[name, f"{c['identical']}/{r['prompts']}", c["first_divergence"]]
            for name, c in r["comparisons"].items()]  # fmt: skip
    out = [f"{r['model']}, {r['prompts']} prompts x {r['tokens_per_prompt']} tokens, fp32, "
           f"against {r['reference']}", "",
           *_table(["run", "identical", "first divergence per prompt"], rows)]  # fmt: skip
    return out + [f"- {name} failed: {error}" for name, error in r["errors"].items()]


def _ledger(r: dict) -> list[str]:
    rows, refused = [], set()
    for row in r["rows"]:
        b = "contiguous" if row.get("layout") == "contiguous" else row["block_size"]
        where = [b, row["context_len"], row["batch"]]
        if "refused" in row:
            refused.add(f"B={row['block_size']}: {'; '.join(row['refused'])}")
        elif "median_ms" not in row:
            rows.append([*where, "-", "-", "-", row.get("skipped") or row.get("error")])
        else:
            rows.append([*where, f"{row['variant']} ({row['num_splits']})",
                         f"{row['median_ms']:.3f}", f"{row['gb_s']:.0f}",
                         f"{row['of_copy_bw']:.0%}"])  # fmt: skip
    s = r["shape"]
    out = [f"decode attention, {s['num_q_heads']}/{s['num_kv_heads']} heads of {s['head_dim']}"
           f", {s['dtype']}, tiles of {r.get('tile_tokens', '?')} tokens; device-to-device copy "
           f"{r['copy_gb_s']:.0f} GB/s", "",
           *_table(["B", "context", "batch", "splits", "ms", "GB/s", "of copy"], rows),
           "", *sorted(refused)]  # fmt: skip
    if ratios := r.get("paged_over_contiguous"):
        out += ["", "paged / contiguous (the same kernel, the rule's splits):", "",
                *_table(["B", "context", "batch", "ratio"],
                        [[x["block_size"], x["context_len"], x["batch"], f"{x['ratio']:.3f}"]
                         for x in ratios])]  # fmt: skip
    if prefill := r.get("prefill"):
        out += ["", "prefill attention, one whole prompt (causal), B = 16:", "",
                *_table(["context", "pagedkv ms", "TFLOP/s", "torch SDPA ms", "TFLOP/s",
                         "pagedkv / SDPA"],
                        [[p["context_len"], f"{p['pagedkv']['median_ms']:.3f}",
                          f"{p['pagedkv']['tflop_s']:.1f}", f"{p['torch_sdpa']['median_ms']:.3f}",
                          f"{p['torch_sdpa']['tflop_s']:.1f}", f"{p['pagedkv_over_sdpa']:.2f}"]
                         for p in prefill])]  # fmt: skip
    return out + [f"- {k} failed: {e}" for k, e in r.get("prefill_errors", {}).items()]


def _engine(r: dict) -> list[str]:
    ratios = r.get("ratio_vs_transformers", {})
    rows = [[f"pagedkv {k}", f"{v['tokens_per_s']:.0f}", f"{v['seconds']:.1f}", v["steps"],
             v["graph_replays"], v["preemptions"], f"{ratios[k]:.2f}x" if k in ratios else "-"]
            for k, v in r["pagedkv"].items()]  # fmt: skip
    if t := r.get("transformers"):
        rows.append([f"transformers generate (batches of {t['batch_size']}, {t['requests_run']}"
                     " requests)", f"{t['tokens_per_s']:.0f}", f"{t['seconds']:.1f}", "-", "-",
                     "-", "1x"])  # fmt: skip
    speedup = r.get("cuda_graphs_speedup")
    pool = r.get("default_pool")
    pool_lines = ["", f"default settings: a KV pool of {pool['kv_cache_gib']:.1f} GiB = "
                  f"{pool['num_blocks']} blocks of {pool['block_size']} tokens",
                  *[f"- {line}" for line in pool["startup"]]] if pool else []  # fmt: skip
    same = r.get("same_tokens_as_eager") or {}
    same_lines = [f"- {k}: {v:.0%} of outputs token-for-token equal to eager's" for k, v in
                  same.items()]  # fmt: skip
    if (both := r.get("async_same_tokens")) is not None:
        same_lines.append(f"- one step ahead vs synchronous, both graphed: {both:.0%} of "
                          "outputs equal")  # fmt: skip
    return [f"{r['model']}, {r['requests']} requests, {r['prompt_tokens']} prompt and "
            f"{r['output_tokens']} output tokens"
            + (f"; CUDA graphs {speedup:.2f}x eager" if speedup else "")
            + (f"; one step ahead {r['async_speedup']:.2f}x" if r.get("async_speedup") else ""),
            "",
            *_table(["run", "output tok/s", "s", "steps", "graph replays", "preemptions",
                     "vs transformers"], rows),
            *same_lines,
            *[f"- {name} failed: {error}" for name, error in r["errors"].items()],
            *_batch1(r.get("batch1")), *_gemms(r.get("prompt_gemms")), *pool_lines]  # fmt: skip


def _batch1(b: dict | None) -> list[str]:
    if not b:
        return []
    return ["", f"batch 1 ({b['prompt_tokens']}-token prompt, graphs, one step ahead): "
            f"{b['ms_per_token']:.2f} ms/token; memory limit {b['memory_limit_ms']:.2f} ms "
            f"({(b['weight_bytes'] + b['kv_bytes_per_step']) / 1e9:.1f} GB at "
            f"{b['copy_gb_s']:.0f} GB/s): {b['of_memory_limit']:.0%} of it"
            + ("" if b.get("host_syncs") is None else
               f"; hidden host syncs in the run: {b['host_syncs']} "
               f"over {b['decode_steps']} decode steps")]  # fmt: skip


def _gemms(g: dict | None) -> list[str]:
    if not g:
        return []
    sq = g["square"]
    return ["", f"prompt GEMMs at {g['rows']} rows (square {sq['dim']}^3 bf16: "
            f"{sq['tflop_s']:.0f} TFLOP/s)", "",
            *_table(["projection", "in x out", "engine TFLOP/s", "F.linear TFLOP/s",
                     "engine / linear", "of square"],
                    [[k, f"{p['in']} x {p['out']}", f"{p['engine']['tflop_s']:.0f}",
                      f"{p['linear']['tflop_s']:.0f}", f"{p['engine_over_linear']:.2f}",
                      f"{p['engine_of_square']:.0%}"]
                     for k, p in g["projections"].items()])]  # fmt: skip


def _service(r: dict) -> list[str]:
    rows = [[name, "ok" if c.get("ok") else "**FAIL**",
             c.get("error") or ", ".join(f"{k} {v}" for k, v in c.items()
                                         if k not in ("ok", "texts", "table", "text"))]
            for name, c in r["cases"].items()]  # fmt: skip
    passed = sum(bool(c.get("ok")) for c in r["cases"].values())
    startup = [f"- {name}: {line}" for name, lines in r["startup"].items() for line in lines]
    return [f"{r['model']}: {passed}/{len(rows)} cases ok", "",
            *_table(["case", "", "what it saw"], rows), "", *startup,
            *[f"- {name}: {error}" for name, error in r["errors"].items()]]  # fmt: skip


def _profile_sim(r: dict) -> list[str]:
    return [r["profile"], "",
            f"measured {r['measured_s']:.2f} s, simulator {r['predicted_s']:.2f} s: "
            f"{r['rel_error']:+.1%}; steps {r['steps']}, preemptions {r['preemptions']}"]  # fmt: skip


def _clock(r: dict) -> list[str]:
    from gpu_check_clock import clock_markdown  # the section's own module renders it

    return clock_markdown(r)


def _mla(r: dict) -> list[str]:
    from gpu_check_mla import mla_markdown  # the section's own module renders it

    return mla_markdown(r)


_RENDER = {"kernels": _kernels, "greedy": _greedy, "service": _service, "ledger": _ledger,
           "mla": _mla, "engine": _engine, "profile_sim": _profile_sim, "clock": _clock}  # fmt: skip
