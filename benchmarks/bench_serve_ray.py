"""pagedkv's request router vs Serve's default (power of two choices) for 2 engine replicas on
Ray Serve, in the same run, on multi-turn conversations of the Mooncake trace, with the
simulator's prediction (``pagedkv simulate --replicas 2``'s cluster) beside each.

One local Ray (``--ray-num-cpus``, default 2); each round deploys the application once per
router (2 replicas of the embedded SmolLM2 unless --model, ``--replica-cpus`` each), replays
the slice open-loop on its arrival times (``serve_ray_slice.py``: every request shares its
conversation's history with an earlier turn), and deletes it: every run starts from cold
caches. Rounds alternate the order. Per run: the prefix hit rate (``cached_tokens`` /
prompt tokens, from each answer's usage), the makespan (first send to last answer),
throughput (requests and output tokens per second), mean and p90 latency, and how the
requests split over the replicas. The simulator replays the same scaled requests with a cost
profile of this machine (``pagedkv profile --quick`` first, or --profile FILE), with the
router ``prefix-aware`` and ``least-loaded`` (Serve's power of two with 2 replicas compares
both: the least loaded, ties at random).

    python benchmarks/bench_serve_ray.py [--rounds 2] [--profile FILE] [--json results/bench_serve_ray.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from common import finish_meta, machine_line, machine_meta, medians, round_order, write_json
from serve_ray_slice import SliceSpec, conversation_slice, replay, simulate

# name -> (--replica-routing, --hint-ttl); the simulator's router for each
ROUTERS = {
    "pagedkv": ("prefix-aware", 60.0),
    "serve-pow2": ("power-of-two", 0.0),
    "pagedkv-no-hints": ("prefix-aware", 0.0),
}
SIM_ROUTERS = {
    "pagedkv": "prefix-aware",
    "serve-pow2": "least-loaded",
    "pagedkv-no-hints": "prefix-aware",
}


def app_config(args, name: str, port: int):
    from pagedkv.engine import EngineConfig
    from pagedkv.serve_ray.config import ServeRayConfig
    from pagedkv.server import ServerConfig

    engine = EngineConfig(
        model=args.model,
        block_size=args.block_size,
        log_startup=False,
        max_num_seqs=args.max_num_seqs,
    )
    return ServeRayConfig(
        engine=engine,
        server=ServerConfig("bench", port=port, log_level="warning"),
        num_replicas=2,
        routing=ROUTERS[name][0],
        hint_ttl_s=ROUTERS[name][1],
        balance_abs=args.balance_abs,
        replica_num_cpus=args.replica_cpus,
        stats_period_s=0.25,
    )


def run_once(args, name: str, requests, port: int) -> tuple[dict, int]:
    from ray import serve

    from pagedkv.serve_ray.launch import start_app

    start_app(app_config(args, name, port))
    base = f"http://127.0.0.1:{port}"
    try:
        result = replay(base, requests, args.vocab_size)
        routers = httpx.get(f"{base}/pagedkv/replicas", timeout=60).json()["routers"]
        result["decisions"] = routers[0]["decisions"] if routers else None
        info = httpx.get(f"{base}/metrics", timeout=60).text  # the router knows them now
        blocks = [
            float(ln.rsplit(" ", 1)[1])
            for ln in info.splitlines()
            if ln.startswith("pagedkv_kv_blocks_total")
        ]
    finally:
        serve.delete("pagedkv")
    return result, int(min(blocks))


def cost_profile(args) -> str:
    if args.profile:
        return args.profile
    path = Path(args.json).with_name("bench_serve_ray_profile.json")
    cmd = [
        sys.executable,
        "-m",
        "pagedkv",
        "profile",
        "--quick",
        "--threads",
        "1",
        "--block-sizes",
        str(args.block_size),
        "-o",
        str(path),
    ]
    if args.model:
        cmd += ["--model", args.model]
    subprocess.run(cmd, check=True)
    return str(path)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--rounds", type=int, default=2)
    a("--model", help="default: the embedded SmolLM2-135M")
    a("--vocab-size", type=int, default=49152, help="the model's (SmolLM2: 49152)")
    a("--block-size", type=int, default=16)
    a("--max-num-seqs", type=int, default=16)
    a("--balance-abs", type=int, default=4)
    a("--replica-cpus", type=float, default=1.0)
    a("--ray-num-cpus", type=int, default=2)
    a("--time-scale", type=float, default=SliceSpec.time_scale)
    a("--conversations", type=int, default=SliceSpec.conversations)
    a("--profile", help="a `pagedkv profile` JSON (default: measure one, --quick)")
    a("--json", default="results/bench_serve_ray.json")
    a(
        "--variants",
        type=lambda t: t.split(","),
        default=["pagedkv", "serve-pow2"],
        help=f"comma list of {', '.join(ROUTERS)} (default pagedkv,serve-pow2)",
    )
    a(
        "--sim-only",
        action="store_true",
        help="keep --json's Serve runs, redo the simulator's prediction (--profile)",
    )
    return p.parse_args()


def serve_runs(args, requests) -> tuple[dict[str, list[dict]], int]:
    """Every router's runs, rounds alternating the order; and the replicas' pool in blocks."""
    import ray
    from tests.kvstore.redis_server import free_port

    ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    num_blocks, port = 0, free_port()  # Serve's proxy keeps its first port
    try:
        for rnd in range(args.rounds):
            for name in round_order(args.variants, rnd):
                result, num_blocks = run_once(args, name, requests, port)
                runs[name].append(result)
                shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
                print(f"round {rnd + 1} {name}: {shown}", flush=True)
    finally:
        ray.shutdown()
    return runs, num_blocks


def main() -> None:
    args = parse_args()
    spec = SliceSpec(time_scale=args.time_scale, conversations=args.conversations)
    requests = conversation_slice(spec)
    meta = machine_meta(workload=spec.describe(), num_requests=len(requests))
    profile = cost_profile(args)  # before Ray: the profile times this machine unloaded
    if args.sim_only:
        import json

        old = json.loads(Path(args.json).read_text())
        meta, runs, num_blocks = old["meta"], old["runs"], old["num_blocks"]
    else:
        runs, num_blocks = serve_runs(args, requests)
    slots = num_blocks * args.block_size
    sims = {
        name: simulate(
            requests, profile, slots, args.block_size, router, args.balance_abs, args.max_num_seqs
        )
        for name, router in SIM_ROUTERS.items()
        if name in runs
    }
    report(args, meta, runs, sims, spec, num_blocks, profile)


def report(args, meta, runs, sims, spec, num_blocks, profile) -> None:
    keys = (
        "hit_rate",
        "makespan_s",
        "requests_per_s",
        "output_tokens_per_s",
        "p50_latency_s",
        "p90_latency_s",
    )
    med = {name: medians({k: [r[k] for r in rs] for k in keys}) for name, rs in runs.items()}
    sim = {
        name: {
            "hit_rate": s["prefix_hit_rate"],
            "makespan_s": s["duration_s"],
            "p50_latency_s": s["e2e_p50_s"],
            "p90_latency_s": s["e2e_p90_s"],
            "routing_decisions": s["routing_decisions"],
        }
        for name, s in sims.items()
    }
    print(
        f"\n{spec.describe()}; {len(conversation_slice(spec))} requests; 2 replicas x "
        f"{num_blocks} blocks of {args.block_size}; {args.rounds} rounds\n{machine_line(meta)}\n"
    )
    print(
        "| router | prefix hit rate | simulated | makespan s | simulated | req/s | out tok/s "
        "| p50 latency s | simulated | p90 latency s | simulated |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in runs:
        m, s = med[name], sim[name]
        print(
            f"| {name} ({ROUTERS[name][0]}) | {m['hit_rate']:.3f} | {s['hit_rate']:.3f} | "
            f"{m['makespan_s']:.1f} | {s['makespan_s']:.1f} | {m['requests_per_s']:.3f} | "
            f"{m['output_tokens_per_s']:.1f} | {m['p50_latency_s']:.2f} | "
            f"{s['p50_latency_s']:.2f} | {m['p90_latency_s']:.2f} | {s['p90_latency_s']:.2f} |"
        )
    ratio = med["serve-pow2"]["makespan_s"] / med["pagedkv"]["makespan_s"]
    print(f"\nthroughput pagedkv / serve-pow2 (makespan ratio): {ratio:.2f}x")
    meta = meta if "load_avg_after" in meta else finish_meta(meta)  # --sim-only keeps it
    out = {
        "meta": meta,
        "workload": spec.describe(),
        "num_blocks": num_blocks,
        "profile": profile,
        "runs": runs,
        "median": med,
        "simulated": sim,
        "throughput_ratio": ratio,
    }
    write_json(args.json, out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests' free_port
    threading.excepthook = lambda a: print(f"thread failed: {a.exc_value!r}", file=sys.stderr)
    main()
