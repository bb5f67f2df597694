"""`pagedkv generate`: run a model on prompts, batched, with paged KV.

One prompt streams its text to the terminal; several run as one continuous batch and print as
they finish. Ends with a short stats table. Without ``--model`` the embedded
SmolLM2-135M-Instruct runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedkv.units import parse_bytes

DEFAULT_SYSTEM = "You are a helpful assistant."


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model and KV cache options shared by the commands that run the engine."""
    g = p.add_argument_group("model and KV cache")
    g.add_argument("--model", help="GGUF file or Hugging Face folder (default: embedded SmolLM2)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument(
        "--policy",
        default="vllm",
        help="paging policy: vllm (paged 16), sglang (radix 1), trtllm (paged 64), llamacpp, "
        "deepinfer (paged 128), reserved (contiguous max_model_len), or paged:B / radix:B",
    )
    g.add_argument("--block-size", type=int, help="tokens per block (default: the policy's)")
    g.add_argument("--kv-cache-memory", default="512MiB", help="KV pool size (default 512MiB)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="running sequences at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    g.add_argument("--max-model-len", type=int, help="context length (default min(model, 2048))")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens per sample")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, help="per-request seed (sample i uses seed + i)")
    g.add_argument("-n", type=int, default=1, help="samples per prompt (forked, copy-on-write)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    g.add_argument("--logprobs", type=int, help="report the chosen token's logprob and N top")


def engine_config(args: argparse.Namespace, **overrides):
    from pagedkv.engine import EngineConfig

    fields = dict(
        model=args.model,
        dtype=args.dtype,
        policy=args.policy,
        block_size=args.block_size,
        kv_cache_memory_bytes=parse_bytes("--kv-cache-memory", args.kv_cache_memory),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def sampling_params(args: argparse.Namespace):
    from pagedkv.engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        n=args.n,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="run the model on prompts with paged KV (embedded SmolLM2 by default)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (one or more)")
    p.add_argument("--prompts-file", type=Path, help="one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt for --chat")
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        try:
            lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read --prompts-file: {exc}") from None
        prompts.extend(line for line in lines if line.strip())
    if not prompts:
        raise ValueError("give at least one PROMPT or --prompts-file")
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    params = sampling_params(args)
    config = engine_config(args)
    from pagedkv.engine import LLMEngine

    engine = LLMEngine(config)
    if args.chat:
        prompts = [
            engine.tokenizer.apply_chat_template(
                [{"role": "system", "content": args.system}, {"role": "user", "content": p}]
            )
            for p in prompts
        ]
    if len(prompts) == 1 and params.n == 1 and not args.json:
        for delta, out in engine.stream(prompts[0], params):
            sys.stdout.write(delta)
            sys.stdout.flush()
            outputs = [out]
        sys.stdout.write("\n")
    else:
        outputs = engine.generate(prompts, params)
        for i, out in enumerate(outputs):
            if args.json:
                print(json.dumps(_as_json(out), ensure_ascii=False))
                continue
            for c in out.outputs:
                label = f"[{i}]" if params.n == 1 else f"[{i}.{c.index}]"
                body = out.error if out.error else c.text.strip()
                print(f"{label} ({c.finish_reason}) {body}")
    if not args.json:
        print_stats(engine.stats(), title=f"pagedkv generate — policy {engine.parts.policy.name}")
    errors = sum(1 for o in outputs if o.error)
    return 1 if errors == len(outputs) else 0


def _as_json(out) -> dict:
    return {
        "request_id": out.request_id,
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
        "error": out.error,
        "outputs": [
            {"index": c.index, "text": c.text, "token_ids": c.token_ids,
             "finish_reason": c.finish_reason, "logprobs": c.logprobs}
            for c in out.outputs
        ],
    }  # fmt: skip


def print_stats(stats, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in stats.rows():
        table.add_row(label, value)
    Console(stderr=True).print(table)
