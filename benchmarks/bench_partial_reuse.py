"""Partial-block prefix reuse (``--prefix-match-unit``, issue 59), measured four ways:

* ``sim``: prefix-hit tokens on the shared-prefix traces through the simulator (Llama-3-8B on the
  fitted A100-80GB clock, paged with a prefix cache) at B = 16, 64, 128, whole blocks (U = B)
  beside U = 1: the Mooncake conversation trace (``--sim-requests`` of it), whose shared prefixes
  are its 512-token hash blocks, and a synthetic workload of a shared 300-token system prompt
  and 3-turn conversations (lengths that are no multiple of anything);
* ``engine``: the same counts from the real engine beside the simulator on a slice of each,
  the engine replayed on the simulator's clock (every step costs ``STEP_S``, requests join at
  step boundaries once arrived), with the same scheduler limits and pool in blocks: the same
  schedule. It runs a tiny random Llama whose vocabulary gives every distinct token of the
  slice its own id and which samples only ids no prompt holds, like the simulator's answers
  (the counts are the scheduler's and the allocator's, not the model's). With whole blocks any
  difference would be a bug; with U = 1 a tie between cached blocks sharing the longest prefix
  is broken by the tokens after it (the engine's answers, the simulator's fresh ids), so one
  side may claim a block the other copies, and the caches drift apart a little;
* ``copy``: the CPU cost of a partial copy per block against recomputing its tokens, on the
  embedded SmolLM2-135M (fp32): the copy of B - 1 slots of every layer (the mover's own path,
  the native backend's block copy), and the time-to-first-token of one request whose hit ends
  B - 1 tokens into a block, with whole blocks (recompute them) and with U = 1 (copy them),
  alternated round by round; medians;
* ``plan``: ``pagedkv plan``'s W(B) and recommendation with and without ``--prefix-match-unit``.

    python benchmarks/bench_partial_reuse.py [--sections sim,engine,copy,plan] [--repeats 7]

Writes results/bench_partial_reuse.json (``--out``); the numbers are in docs/partial_reuse.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import REPO, alternate_s, finish_meta, machine_line, machine_meta, medians, write_json
from pagedkv.traces import require_shared_trace
from partial_reuse_engine import BLOCK_SIZES, MOONCAKE, SYNTHETIC, engine_section

# -- sim -----------------------------------------------------------------------------------------


def sim_section(args: argparse.Namespace) -> dict:
    from pagedkv.sim.scenario_load import load_scenario
    from pagedkv.sim.simulate_config import SimulateConfig

    out = {}
    workloads = {
        "mooncake": {
            "trace": str(require_shared_trace(MOONCAKE)),
            "max_requests": args.sim_requests,
        },
        "synthetic": {"synthetic": SYNTHETIC.format(n=args.synthetic_conversations)},
    }
    for name, source in workloads.items():
        config = SimulateConfig(
            **source,
            model="llama-3-8b",
            gpu="A100-80GB",
            policies=("vllm",),
            block_sizes=BLOCK_SIZES,
            prefix_match_units=(None, 1),
            max_model_len=32768,
        )
        scenario = load_scenario(config)
        rows = []
        for _, s in scenario.run():
            rows.append(
                {
                    k: s.get(k)
                    for k in (
                        "policy",
                        "block_size",
                        "prefix_match_unit",
                        "prompt_tokens",
                        "prefix_hit_tokens",
                        "ideal_prefix_hit_tokens",
                        "partial_hits",
                        "partial_claims",
                        "prefix_copy_bytes",
                        "prefix_copy_time_s",
                        "ttft_p50_s",
                        "ttft_p99_s",
                        "throughput_tokens_per_s",
                        "num_finished",
                        "refused",
                        "wall_time_s",
                    )
                }
            )
            print(f"  sim {name} {s['policy']}: {s['prefix_hit_tokens']:,} hit tokens", flush=True)
        out[name] = {"source": scenario.source, "clock": scenario.clock(), "runs": rows}
    return out


# -- the CPU cost of a partial copy ----------------------------------------------------------------


def copy_section(args: argparse.Namespace) -> dict:
    import torch

    from pagedkv.model import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(None, "float32", progress=False)
    return {f"B={b}": copy_point(loaded, b, args.repeats) for b in BLOCK_SIZES}


def copy_point(loaded, block_size: int, repeats: int) -> dict:
    """One block size: a hit ending ``B - 1`` tokens into the block after 512 cached tokens,
    then a 32-token suffix; whole blocks recompute those ``B - 1``, U = 1 copies them."""
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedkv.engine.startup import build_parts
    from pagedkv.kvcache.tiers.contract import PrefixCopy
    from pagedkv.sched.batch import ScheduledBatch

    m, context, suffix = block_size - 1, 512, 32
    engines = {}
    for label, unit in (("U=B", None), ("U=1", 1)):
        config = EngineConfig(
            block_size=block_size,
            prefix_match_unit=unit,
            log_startup=False,
            kv_cache_memory_bytes=96 << 20,
            adapt_threads=False,
        )
        engines[label] = LLMEngine(config, parts=build_parts(config, loaded))
    base = [1000 + (i * 7919) % 40000 for i in range(context + block_size)]
    for engine in engines.values():  # cached: the context and one more block
        engine.generate([base], SamplingParams(max_tokens=1))
    fresh = iter(range(10**6))

    def ttft(engine: LLMEngine) -> None:
        k = next(fresh)  # a new suffix each time: only the shared prefix is cached
        prompt = base[: context + m] + [45000 + (k * 31 + j) % 4000 for j in range(suffix)]
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=1))
        want = context + m if engine.info.prefix_match_unit else context
        assert out.num_cached_tokens == want, (out.num_cached_tokens, want)

    times = medians(alternate_s({k: (lambda e=e: ttft(e)) for k, e in engines.items()}, repeats))
    mover = engines["U=1"].runner.mover
    last = mover.kv_caches[0][0].shape[0] - 1
    batch = ScheduledBatch(0, (), prefix_copies=(PrefixCopy(1, last, m),))
    copy_s = medians(alternate_s({"copy": lambda: mover.before_forward(batch)}, 5 * repeats))
    record = engines["U=1"].info.record_bytes
    row = {
        "copied_tokens": m,
        "copied_bytes": m * record,
        "copy_s": copy_s["copy"],
        "ttft_whole_blocks_s": times["U=B"],
        "ttft_partial_s": times["U=1"],
        "recompute_minus_copy_s": times["U=B"] - times["U=1"],
        "recompute_s": times["U=B"] - times["U=1"] + copy_s["copy"],
    }
    print(f"  copy B={block_size}: {row}", flush=True)
    return row


# -- the planner -----------------------------------------------------------------------------------


def plan_section(args: argparse.Namespace) -> dict:
    workloads = {
        "mooncake": ["--trace", str(require_shared_trace(MOONCAKE)), "--num-seqs", "64"],
        "prefix-range": [
            "--num-seqs",
            "128",
            "--mean-len",
            "2048",
            "--max-len",
            "8192",
            "--prefix-range",
            "64:1024",
        ],
    }
    out = {}
    for name, work in workloads.items():
        for label, unit in (("U=B", []), ("U=1", ["--prefix-match-unit", "1"])):
            cmd = [
                sys.executable,
                "-m",
                "pagedkv",
                "plan",
                "--model",
                "llama-3-8b",
                "--gpu",
                "H100-80GB",
                "--block-sizes",
                "8,16,32,64,128",
                "--json",
                *work,
                *unit,
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
            report = json.loads(done.stdout)
            out[f"{name} {label}"] = {
                "command": "pagedkv " + " ".join(cmd[3:]),
                "recommended": report["recommendation"]["block_size"],
                "reasons": report["recommendation"]["reasons"],
                "rows": {
                    r["block_size"]: {
                        k: r[k]
                        for k in (
                            "prefix_lost_tokens",
                            "prefix_waste_mb",
                            "total_mb",
                            "decode_step_ms",
                            "prefix_copy_tokens",
                            "prefix_copy_us",
                            "prefix_recompute_us",
                        )
                    }
                    for r in report["rows"]
                },
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="sim,engine,copy,plan")
    p.add_argument("--sim-requests", type=int, default=None, help="Mooncake requests (all)")
    p.add_argument("--synthetic-conversations", type=int, default=2000)
    p.add_argument("--engine-requests", type=int, default=40)
    p.add_argument("--engine-scan", type=int, default=3000, help="Mooncake requests searched")
    p.add_argument("--engine-partial-cases", type=int, default=8)
    p.add_argument("--engine-conversations", type=int, default=60)
    p.add_argument("--engine-context", type=int, default=8192)
    p.add_argument("--engine-max-output", type=int, default=16)
    p.add_argument("--engine-max-seqs", type=int, default=16)
    p.add_argument("--engine-pool-tokens", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "results" / "bench_partial_reuse.json"))
    args = p.parse_args()
    meta = machine_meta(args=vars(args))
    print(machine_line(meta), flush=True)
    sections = {
        "sim": sim_section,
        "engine": engine_section,
        "copy": copy_section,
        "plan": plan_section,
    }
    result = {}
    for name in args.sections.split(","):
        print(f"{name}:", flush=True)
        result[name] = sections[name](args)
    write_json(args.out, {"meta": finish_meta(meta), **result})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
