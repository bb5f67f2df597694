"""The engine next to the peers on this machine, on the embedded SmolLM2-135M (fp32 weights).

1. Throughput: 32 prompts x 128 new greedy tokens through pagedkv (paged, B=16) and through
   Hugging Face transformers on the same GGUF weights: ``generate`` with padded batching, and
   its continuous-batching ``generate_batch`` when the installed version has it. Runs alternate
   (ours, peer, ours, peer, ...) and the medians and ratios are reported.
2. Paging overhead: median decode step time of 16 running sequences on the paged pool (B=16)
   vs the reserved contiguous baseline (same engine, same path), alternating.
3. Capacity: one fixed KV pool, a mixed-length batch; peak concurrent sequences and steps
   under ``reserved`` vs ``vllm`` -- the second article's experiment on a real model.

Writes results/bench_engine.json and prints markdown tables. Nothing here is asserted.

    python benchmarks/bench_engine.py [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model
from pagedkv.model.embedded import EMBEDDED_FILE_NAME, embedded_model_path

TOPICS = ["the ocean", "a lighthouse", "compilers", "bread", "winter", "a violin", "trains",
          "the moon", "gardening", "chess", "volcanoes", "libraries", "bees", "rain", "maps",
          "glass"]  # fmt: skip


def prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts of varied length (about 10 to 60 tokens), as token ids."""
    out = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Write a short essay about {topic}. " + "Be specific and vivid. " * (i % 6)
        out.append(tokenizer.encode(text))
    return out


def engine_on(loaded, **overrides) -> LLMEngine:
    config = EngineConfig(log_startup=False, max_model_len=512, max_num_seqs=64, **overrides)
    return LLMEngine(config, parts=build_parts(config, loaded))


def run_ours(engine: LLMEngine, ids: list[list[int]], new_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(ids, params)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf_padded(model, ids: list[list[int]], new_tokens: int, pad_id: int):
    from transformers import GenerationConfig

    width = max(map(len, ids))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=pad_id, eos_token_id=None)  # fmt: skip
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=cfg)
    elapsed = time.perf_counter() - t0
    return elapsed, int((out.shape[1] - width) * out.shape[0])


def run_hf_continuous(model, ids: list[list[int]], new_tokens: int, pad_id: int):
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=pad_id, eos_token_id=None)  # fmt: skip
    t0 = time.perf_counter()
    with torch.inference_mode():
        res = model.generate_batch(inputs=ids, generation_config=cfg, progress_bar=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(r.generated_tokens) for r in res.values())


def bench_throughput(
    loaded, hf, repeats: int, num_prompts: int, new_tokens: int, dtype: str = "float32"
) -> dict:
    """Ours and the peers on the same weights at ``dtype``, alternating; medians and ratios."""
    tokenizer = loaded[2]
    ids = prompts(tokenizer, num_prompts)
    pad_id = tokenizer.eos_token_id or 0
    peers = {"transformers generate (padded)": run_hf_padded}
    if hasattr(hf, "generate_batch"):
        peers["transformers generate_batch (continuous)"] = run_hf_continuous
    rates: dict[str, list[float]] = {"pagedkv": [], **{k: [] for k in peers}}
    for _ in range(repeats):
        engine = engine_on(loaded, kv_cache_memory_bytes=1 << 30, dtype=dtype)
        secs, toks = run_ours(engine, ids, new_tokens)
        rates["pagedkv"].append(toks / secs)
        for name, fn in peers.items():
            try:
                secs, toks = fn(hf, ids, new_tokens, pad_id)
                rates[name].append(toks / secs)
            except Exception as exc:  # a peer API that does not run on CPU is reported, not fatal
                print(f"{name} failed: {exc!r}")
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    return {"tokens_per_s": med, "ratio": {k: med["pagedkv"] / v for k, v in med.items()}}


def decode_step_times(engine: LLMEngine, ids, new_tokens: int) -> float:
    """Median wall time of the steps in which every scheduled sequence decodes one token."""
    for p in ids:
        engine.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        batch_size_before = engine.snapshot().num_running_seqs
        engine.step()
        if batch_size_before == len(ids):  # all prompts computed: a pure decode step
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_paging_overhead(loaded, repeats: int, num_seqs: int, new_tokens: int) -> dict:
    ids = prompts(loaded[2], num_seqs)
    step = {"paged B=16": [], "reserved": []}
    for _ in range(repeats):
        for name, policy in (("paged B=16", "vllm"), ("reserved", "reserved")):
            engine = engine_on(loaded, policy=policy, kv_cache_memory_bytes=1 << 30)
            step[name].append(decode_step_times(engine, ids, new_tokens))
    med = {k: statistics.median(v) * 1e3 for k, v in step.items()}
    return {"decode_step_ms": med, "paged_over_reserved": med["paged B=16"] / med["reserved"]}


def bench_capacity(loaded, num_requests: int) -> dict:
    tokenizer = loaded[2]
    ids = [tokenizer.encode("Summarise: " + "lorem ipsum dolor sit amet " * (2 + 7 * (i % 8)))
           for i in range(num_requests)]  # fmt: skip
    params = [SamplingParams(max_tokens=8 + 8 * (i % 4), ignore_eos=True) for i in range(len(ids))]
    out = {}
    for policy in ("reserved", "vllm"):
        engine = engine_on(loaded, policy=policy, kv_cache_memory_bytes=64 << 20)
        engine.generate(ids, params)
        s = engine.stats()
        out[policy] = {"peak_running": s.peak_running, "steps": s.num_steps,
                       "kv_utilization_peak": round(s.kv_utilization_peak, 3)}  # fmt: skip
    out["prompt_tokens"] = [len(p) for p in ids]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 prompts x 32 tokens (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_engine.json"))
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--bf16", action="store_true", help="also compare both sides in bf16")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    num_prompts, new_tokens = (8, 32) if args.quick else (32, 128)
    import transformers

    path = embedded_model_path()

    def both(dtype: str):
        ours = load_model(None, dtype=dtype, progress=False)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=EMBEDDED_FILE_NAME, dtype=getattr(torch, dtype)
        ).eval()
        return ours, hf

    loaded, hf = both("float32")
    throughput = {"float32": bench_throughput(loaded, hf, args.repeats, num_prompts, new_tokens)}
    if args.bf16:
        loaded16, hf16 = both("bfloat16")
        throughput["bfloat16"] = bench_throughput(
            loaded16, hf16, args.repeats, num_prompts, new_tokens, dtype="bfloat16"
        )
        del loaded16, hf16
    result = {
        "meta": {"python": platform.python_version(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                 "prompts": num_prompts, "new_tokens": new_tokens, "repeats": args.repeats},
        "throughput": throughput,
        "paging_overhead": bench_paging_overhead(loaded, args.repeats, 16, new_tokens // 2),
        "capacity": bench_capacity(loaded, 24),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"| engine ({num_prompts} prompts x {new_tokens} tokens) | dtype | tokens/s | pagedkv / it |"
    )
    print("|---|---|---:|---:|")
    for dtype, thr in result["throughput"].items():
        for name, rate in thr["tokens_per_s"].items():
            print(f"| {name} | {dtype} | {rate:.1f} | {thr['ratio'][name]:.2f}x |")
    po = result["paging_overhead"]
    print("\n| decode step, 16 seqs | ms |\n|---|---:|")
    for name, ms in po["decode_step_ms"].items():
        print(f"| {name} | {ms:.1f} |")
    print(f"paged / reserved = {po['paged_over_reserved']:.3f}")
    cap = result["capacity"]
    print("\n| policy, 64 MiB pool, 24 mixed requests | peak running | steps |\n|---|---:|---:|")
    for policy in ("reserved", "vllm"):
        print(f"| {policy} | {cap[policy]['peak_running']} | {cap[policy]['steps']} |")


if __name__ == "__main__":
    main()
