"""Is the simulator worth trusting? One trace through the real engine and through the simulator
with a cost profile fitted on this machine, and the error per metric (docs/calibration.md).

The trace: a slice of the Azure LLM 2023 conversation trace scaled to the embedded
SmolLM2-135M on a CPU (prompts divided by --prompt-divisor and capped, outputs divided by
--output-divisor, arrival times stretched by --time-stretch so the load suits the model's
speed). The engine replays it in real time: before each step it adds every request whose
arrival has passed, as the simulator admits requests at step boundaries; every request
generates exactly the trace's output length (ignore_eos); a KV pool of --kv-blocks blocks is
small enough that sequences are preempted. The simulator (``pagedkv.sim.simulator.Simulation``)
replays the same requests with the same scheduler limits, policy and pool, priced by the
profile (measured here first with `pagedkv profile`'s default grid, or --profile FILE).

Time is the process's CPU time with one torch thread (--clock cpu, the default: another
process on a shared machine does not count) or elapsed time (--clock wall: a quiet machine).
The engine replay runs --repeats times (medians, with the spread); the simulator is
deterministic. Also reported: the profile's error on the replay's own steps; the simulator's
preemptions and peak with every step 5 % cheaper or dearer (how timing-sensitive they are);
and one engine replay on the simulator's clock (each step priced by the profile instead of
timed), which must equal the simulator exactly: same scheduling, only step time differs.
Writes results/sim_vs_engine.json (--json) and prints a markdown table.

    python benchmarks/sim_vs_engine.py [--repeats 5] [--profile FILE] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from common import finish_meta, machine_meta, write_json
from pagedkv.commands.profile import grid_plan, measure
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.profiling import CLOCKS, StepRecorder, kv_record_bytes
from pagedkv.engine.startup import build_parts
from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import get_policy
from pagedkv.model import load_model
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.costs.profiled import ProfiledCostModel, read_cost_profile
from pagedkv.sim.metrics import percentile
from pagedkv.sim.simulator import Simulation
from pagedkv.traces import FreshSegments, TraceRequest, load_trace, require_shared_trace

TRACE = "azure_llm_2023_conv.csv"  # the default, among the shared traces
METRICS = ("total_s", "ttft_p50_s", "ttft_p90_s", "mean_e2e_s", "preemptions", "peak_running")


def scaled_requests(args: argparse.Namespace) -> list[TraceRequest]:
    """The slice of the trace, lengths and times scaled (see the module docstring)."""
    raw = load_trace(args.trace, args.start + args.requests)[args.start :]
    fresh, t0 = FreshSegments(), raw[0].arrival_time_s
    out = []
    for r in raw:
        prompt = min(args.max_prompt, max(1, r.prompt_len_tokens // args.prompt_divisor))
        output = min(args.max_output, max(1, r.output_len_tokens // args.output_divisor))
        arrival = (r.arrival_time_s - t0) * args.time_stretch
        out.append(TraceRequest(arrival, fresh.take(prompt), output))
    return out


def engine_config(args: argparse.Namespace, loaded) -> EngineConfig:
    record = kv_record_bytes(loaded[0], "float32")
    return EngineConfig(
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_blocks * args.block_size * record,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_prompt + args.max_output + 1,
        log_startup=False,
        async_scheduling=False,  # StepRecorder times synchronous steps
    )


def _summary(duration, ttfts, e2es, preemptions, peak) -> dict[str, float]:
    return {
        "total_s": duration,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "mean_e2e_s": statistics.fmean(e2es),
        "preemptions": preemptions,
        "peak_running": peak,
    }


def replay_engine(loaded, config: EngineConfig, requests, seed: int, clock: str, cost=None):
    """One replay on a fresh engine; (summary, the timed steps). ``clock`` "wall": arrivals
    on the wall clock, idle gaps slept. "cpu": the replay's clock is this process's CPU time
    and an idle gap is skipped (added to the clock), as the simulator does. With ``cost`` the
    clock is the sum of ``cost``'s prices of the steps run (idle gaps skipped): the engine
    then sees the simulator's time, which isolates the scheduling from the step times."""
    warm = LLMEngine(config, parts=build_parts(config, loaded))
    warm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    rec, rng, vocab = StepRecorder(engine, clock), random.Random(seed), engine.info.vocab_size
    steps, first_s, finish_s, peak, next_req = [], {}, {}, 0, 0
    modeled = [0.0]
    read = CLOCKS[clock] if cost is None else (lambda: modeled[0])
    skipped, t0 = 0.0, read()
    while next_req < len(requests) or engine.has_unfinished():
        now = read() - t0 + skipped
        while next_req < len(requests) and requests[next_req].arrival_time_s <= now:
            r = requests[next_req]
            prompt = [rng.randrange(vocab) for _ in range(r.prompt_len_tokens)]
            params = SamplingParams(max_tokens=r.output_len_tokens, ignore_eos=True)
            engine.add_request(prompt, params, request_id=str(next_req))
            next_req += 1
        if not engine.has_unfinished():
            gap = max(0.0, requests[next_req].arrival_time_s - now)
            if clock == "wall" and cost is None:
                time.sleep(gap)
            else:
                skipped += gap
            continue
        outputs = rec.step()
        if cost is not None and rec.last is not None:
            modeled[0] += cost.step_time_s(rec.last.shape)
        ended = read() - t0 + skipped
        if rec.last is not None:
            steps.append(rec.last)
        peak = max(peak, rec.last_running)
        for o in outputs:
            if o.outputs[0].token_ids:
                first_s.setdefault(o.request_id, ended)
            if o.finished:
                finish_s[o.request_id] = ended
    duration = read() - t0 + skipped
    ttfts = [first_s[str(i)] - r.arrival_time_s for i, r in enumerate(requests)]
    e2es = [finish_s[str(i)] - r.arrival_time_s for i, r in enumerate(requests)]
    preemptions = engine.scheduler.num_preemptions
    return _summary(duration, ttfts, e2es, preemptions, peak), steps


def replay_sim(config: EngineConfig, num_blocks: int, requests, cost) -> dict[str, float]:
    """The simulator on the engine's pool: ``num_blocks`` usable blocks, as the engine reports
    them. The allocators keep one more block than that (the null block that pads block
    tables), so the simulator is given ``num_blocks + 1`` blocks' slots, as ``build_parts``
    gives the engine's allocator."""
    policy = get_policy(config.policy)
    assert policy.block_size == config.block_size, "the benchmark runs the policy's block size"
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        preemption=config.preemption,
    )
    slots = (num_blocks + 1) * config.block_size
    sim = Simulation(requests, policy, slots, scheduler, cost)
    assert sim.allocator.num_total_blocks == num_blocks, "the pools must be the same"
    run = sim.run()
    ttfts = [r.ttft_s for r in run.records]
    e2es = [r.e2e_s for r in run.records]
    return _summary(run.duration_s, ttfts, e2es, run.preemptions, run.peak_running)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help=f"a trace file (default: the shared {TRACE}: ../shared/traces)")
    p.add_argument("--start", type=int, default=0, help="first request of the slice")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt-divisor", type=int, default=8)
    p.add_argument("--output-divisor", type=int, default=4)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--time-stretch", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=40, help="KV pool in blocks (preemptions)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="engine replays (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: robust when shared)")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): steps and the replay timed in this process's CPU time, which a "
        "shared machine does not disturb (one thread only); wall: elapsed time",
    )
    p.add_argument("--profile", help="a cost profile JSON (default: measure one first)")
    p.add_argument("--save-profile", help="write the profile measured here to this file")
    p.add_argument("--json", default="results/sim_vs_engine.json")
    args = p.parse_args()
    try:
        args.trace = args.trace or str(require_shared_trace(TRACE))
    except UsageError as exc:
        p.error(f"--trace: {exc}")
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu needs --threads 1 (CPU time adds up over threads)")
    torch.set_num_threads(args.threads)
    meta = machine_meta()
    requests = scaled_requests(args)
    loaded = load_model(None, progress=False)
    config = engine_config(args, loaded)
    if args.profile:
        profile = read_cost_profile(args.profile)
    else:
        base = EngineConfig(log_startup=False)
        profile = measure(base, grid_plan(), args.threads, 0, True, args.clock, loaded)
        if args.save_profile:
            profile.write(args.save_profile)
    cost = profile.cost_model()
    num_blocks = LLMEngine(config, parts=build_parts(config, loaded)).info.num_blocks
    biggest = max(r.prompt_len_tokens + r.output_len_tokens for r in requests)
    if biggest > num_blocks * args.block_size:  # refused by both: nothing to compare
        raise SystemExit(f"--kv-blocks {args.kv_blocks}: a request of {biggest} tokens never fits")

    sim = replay_sim(config, num_blocks, requests, cost)
    # How much the discrete outcomes move when every step is 5 % slower or faster: the noise
    # band the engine's own runs show too (an arrival lands one step earlier or later).
    band = {
        f"{f:+.0%}": replay_sim(config, num_blocks, requests, ScaledCost(cost, 1 + f))
        for f in (-0.05, 0.05)
    }
    runs, step_errors = [], []
    for i in range(args.repeats):
        summary, steps = replay_engine(loaded, config, requests, i, args.clock)
        runs.append(summary)
        step_errors.append(_step_error(cost, steps))
        print(
            f"engine run {i + 1}/{args.repeats}: "
            + ", ".join(f"{k} {v:.3g}" for k, v in summary.items())
        )
    same_clock = replay_engine(loaded, config, requests, 0, args.clock, cost)[0]
    rows = _table(runs, sim)
    describe = (
        f"{len(requests)} requests of {args.trace} from #{args.start}: prompts/{args.prompt_divisor}"
        f" (<= {args.max_prompt}), outputs/{args.output_divisor} (<= {args.max_output}), times "
        f"x{args.time_stretch}; pool {num_blocks} x {args.block_size} tokens, max_num_seqs "
        f"{args.max_num_seqs}, budget {args.max_num_batched_tokens}; {args.threads} thread(s), {args.clock} clock"
    )
    print(f"\n{describe}\n{profile.describe()}\n")
    print("| metric | engine (median of runs) | engine min..max | simulator | error |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['engine']:.3f} | {row['engine_min']:.3f}..{row['engine_max']:.3f} "
              f"| {row['sim']:.3f} | {row['rel_error']:+.1%} |")  # fmt: skip
    for name in ("preemptions", "peak_running"):
        engine_values = sorted(int(r[name]) for r in runs)
        moved = ", ".join(f"{k}: {int(v[name])}" for k, v in band.items())
        print(f"{name}: engine runs {engine_values}; simulator {int(sim[name])} "
              f"(steps {moved})")  # fmt: skip
    diffs = ", ".join(f"{k} {same_clock[k] - sim[k]:+.3g}" for k in METRICS)
    print(f"engine on the simulator's clock (each step priced by the profile) minus the "
          f"simulator: {diffs}")  # fmt: skip
    print(f"\nprofile on the replay's own steps (summed predicted / measured - 1): "
          f"{', '.join(f'{e:+.1%}' for e in step_errors)}")  # fmt: skip
    result = {
        "setup": describe,
        "profile": profile.describe(),
        "coefficients": profile.model.coefficients,
        "token_offsets_s": profile.model.token_offsets_s,
        "fit": profile.fit.__dict__,
        "metrics": rows,
        "engine_runs": runs,
        "step_cost_errors": step_errors,
        "simulator_cost_band": band,
        "engine_on_simulator_clock": same_clock,
        "meta": finish_meta(meta),
    }
    print(f"wrote {write_json(args.json, result, indent=1)}")


@dataclass(frozen=True)
class ScaledCost:
    cost: ProfiledCostModel
    factor: float

    def step_time_s(self, shape) -> float:
        return self.cost.step_time_s(shape) * self.factor


def _step_error(cost: ProfiledCostModel, steps) -> float:
    measured = sum(s.seconds for s in steps)
    return sum(cost.step_time_s(s.shape) for s in steps) / measured - 1.0


def _table(runs: list[dict[str, float]], sim: dict[str, float]) -> dict[str, dict[str, float]]:
    rows = {}
    for name in METRICS:
        values = [r[name] for r in runs]
        median = statistics.median(values)
        rows[name] = {
            "engine": median,
            "engine_min": min(values),
            "engine_max": max(values),
            "sim": sim[name],
            "rel_error": (sim[name] - median) / median if median else 0.0,
        }
    return rows


if __name__ == "__main__":
    main()
