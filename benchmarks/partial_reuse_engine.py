"""``bench_partial_reuse.py``'s ``engine`` section: the real engine beside the simulator on slices
of the shared-prefix workloads, replayed on the simulator's clock (see that script's
docstring). A module of its own for size; run it through ``bench_partial_reuse.py``."""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

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
