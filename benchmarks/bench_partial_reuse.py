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
import tempfile
from dataclasses import replace
from pathlib import Path

from common import REPO, alternate_s, finish_meta, machine_line, machine_meta, medians, write_json
from pagedkv.kvcache.policies import Policy, get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import LinearCostModel, Simulation
from pagedkv.traces import TraceRequest, load_trace, require_shared_trace, segment_tokens

BLOCK_SIZES = (16, 64, 128)
STEP_S = 0.05  # the engine beside the simulator: every step costs this on the shared clock
MOONCAKE = "mooncake_conversation.jsonl"
# A 300-token system prompt shared by every request and 3-turn conversations whose next turn
# repeats the previous prompt and answer (`pagedkv simulate --synthetic`'s grammar).
SYNTHETIC = "requests={n},prompt=40-300,output=20-120,system=300,turns=3,gap=2,rate=4"


def policies(block_size: int) -> dict[str, Policy]:
    base = get_policy(f"paged:{block_size}")
    return {"U=B": base, "U=1": base.with_prefix_match_unit(1)}


# -- sim -----------------------------------------------------------------------------------------


def sim_section(args: argparse.Namespace) -> dict:
    from pagedkv.sim.scenario import SimulateConfig, load_scenario

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


# -- engine beside the simulator -----------------------------------------------------------------


def slices(args: argparse.Namespace) -> dict[str, list[TraceRequest]]:
    """The engine's workloads, outputs capped (the hits need the schedule only): a slice of
    Mooncake that fits the tiny model's context (its first requests, and the earlier requests
    of its first repeated prompts, whose last block a partial match can reuse: the trace's own
    partial cases), arrival times kept; and the synthetic workload with fewer conversations."""
    from pagedkv.traces import reusable_prefix_tokens
    from pagedkv.traces.synthetic import generate, parse_spec

    cap, context = args.engine_max_output, args.engine_context
    trace = load_trace(require_shared_trace(MOONCAKE), args.engine_scan)
    fits = [i for i, r in enumerate(trace) if r.prompt_len_tokens + cap <= context]
    chosen = set(fits[: args.engine_requests])
    reusable = reusable_prefix_tokens(trace)
    partial = [i for i in fits if reusable[i] % min(BLOCK_SIZES)][: args.engine_partial_cases]
    for i in partial:  # the request and its earlier twins (same leading hash blocks)
        chosen.update(j for j in fits if j <= i and trace[j].prompt[:2] == trace[i].prompt[:2])
    t0 = trace[min(chosen)].arrival_time_s
    mooncake = [
        replace(trace[i], arrival_time_s=trace[i].arrival_time_s - t0) for i in sorted(chosen)
    ]
    synthetic = generate(parse_spec(SYNTHETIC.format(n=args.engine_conversations)), 0, None)
    return {
        name: [
            replace(r, output=(), output_len_tokens=max(1, min(cap, r.output_len_tokens)))
            for r in reqs
        ]
        for name, reqs in (("mooncake", mooncake), ("synthetic", synthetic))
    }


def replay_engine(
    engine, prompts: list[list[int]], reqs: list[TraceRequest], step_s: float, fresh_base: int
) -> None:
    """The requests through ``engine`` on the simulator's clock (``LinearCostModel(step_s)``:
    every step that runs a batch costs ``step_s``): before each step every request that has
    arrived is added, as the simulator admits requests at step boundaries. The same schedule
    as the simulator's, so the same prefix hits."""
    from pagedkv.engine import SamplingParams

    now, i, recorder = 0.0, 0, engine.recorder
    while i < len(reqs) or engine.has_unfinished():
        if not engine.has_unfinished():
            now = max(now, reqs[i].arrival_time_s)
        while i < len(reqs) and reqs[i].arrival_time_s <= now:
            params = SamplingParams(max_tokens=reqs[i].output_len_tokens, ignore_eos=True)
            engine.add_request(prompts[i], params)
            i += 1
        before = recorder.num_steps
        for out in engine.step():
            assert out.error is None, out.error
            assert min(out.outputs[0].token_ids, default=fresh_base) >= fresh_base
        now += step_s if recorder.num_steps > before else 0.0


FRESH_IDS = 1024  # ids above the prompts' the tiny model's samples come from


def tiny_model(folder: Path, num_prompt_ids: int, context: int):
    """A tiny random Llama (2 layers, hidden 32) with ``num_prompt_ids`` ids for the prompts'
    tokens and ``FRESH_IDS`` above them, the only ones it samples (their output rows are zero,
    the others random): like the simulator's fresh answer tokens, an answer never repeats a
    prompt's token, so a block holding one matches no prompt."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from pagedkv.model import load_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=num_prompt_ids + FRESH_IDS,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight[:num_prompt_ids] = 0.0  # logit 0, below the best fresh id's
        model.lm_head.weight[num_prompt_ids:].normal_(0.0, 1.0)
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return load_model(folder, progress=False)


def engine_section(args: argparse.Namespace) -> dict:
    from pagedkv.engine import EngineConfig, LLMEngine
    from pagedkv.engine.startup import build_parts

    work = slices(args)
    ids = sorted({t for reqs in work.values() for r in reqs for t in segment_tokens(r.prompt)})
    remap = {t: i + 3 for i, t in enumerate(ids)}  # one id each: equal tokens stay equal
    with tempfile.TemporaryDirectory() as folder:
        loaded = tiny_model(Path(folder), len(ids) + 3, args.engine_context)
    fresh_base = len(ids) + 3
    record_bytes = 2 * 2 * 1 * 16 * 4  # layers x (K, V) x KV heads x head dim x fp32
    out = {}
    for name, reqs in work.items():
        prompts = [[remap[t] for t in segment_tokens(r.prompt)] for r in reqs]
        rows = []
        for b in BLOCK_SIZES:
            for label, policy in policies(b).items():
                limits = dict(
                    max_num_seqs=args.engine_max_seqs,
                    max_num_batched_tokens=2048,
                    max_model_len=args.engine_context,
                )
                num_blocks = args.engine_pool_tokens // b  # the engine's pool, null block included
                config = EngineConfig(
                    block_size=b,
                    prefix_match_unit=policy.prefix_match_unit,
                    log_startup=False,
                    kv_cache_memory_bytes=num_blocks * b * record_bytes,
                    **limits,
                )
                engine = LLMEngine(config, parts=build_parts(config, loaded))
                replay_engine(engine, prompts, reqs, STEP_S, fresh_base)
                e = engine.allocator.stats()
                sim = Simulation(
                    reqs,
                    policy,
                    num_blocks * b,
                    SchedulerConfig(**limits),
                    LinearCostModel(STEP_S),
                    kv_record_bytes=record_bytes,
                )
                sim.run()
                s = sim.allocator.stats()
                rows.append(
                    {
                        "block_size": b,
                        "unit": label,
                        "prompt_tokens": sum(map(len, prompts)),
                        "engine_hit_tokens": e.prefix_hit_tokens,
                        "sim_hit_tokens": s.prefix_hit_tokens,
                        "engine_partial_hits": e.num_partial_hits,
                        "sim_partial_hits": s.num_partial_hits,
                        "engine_preemptions": engine.stats().preemptions,
                        "sim_preemptions": sim.scheduler.num_preemptions,
                    }
                )
                print(f"  engine {name} B={b} {label}: {rows[-1]}", flush=True)
        out[name] = {"num_requests": len(reqs), "rows": rows}
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
