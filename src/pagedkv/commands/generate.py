"""`pagedkv generate`: run a model on prompts, batched, with paged KV.

One prompt streams its text to the terminal; several run as one continuous batch and print
once all are done, with progress lines on stderr as they finish. Ends with a short stats
table. Without ``--model`` the embedded SmolLM2-135M-Instruct runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedkv.commands.busy_machine import warn_if_busy
from pagedkv.commands.engine_flags import (
    add_engine_args,
    add_sampling_args,
    engine_config,
    print_stats,
    sampling_params,
)
from pagedkv.commands.progress import run_batch
from pagedkv.errors import UsageError


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
    p.add_argument("--system", help="system message for --chat (default: none, the template's own)")
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts, checked before the model loads: none missing, none empty."""
    prompts = list(args.prompts)
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise UsageError(f"PROMPT {i + 1} is empty", param="PROMPT")
    path = args.prompts_file
    if path is not None:
        try:
            lines = path.read_bytes().decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            line = path.read_bytes()[: exc.start].count(b"\n") + 1
            raise UsageError(
                f"--prompts-file {path}:{line}: not UTF-8 text ({exc.reason})"
            ) from None
        except OSError as exc:
            raise UsageError(f"cannot read --prompts-file {path}: {exc.strerror}") from None
        prompts.extend(line for line in lines if line.strip())
    if not prompts:
        raise UsageError("give at least one PROMPT or --prompts-file")
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat (it is a chat message)", "--system")
    params = sampling_params(args)
    config = engine_config(args)
    from pagedkv.engine import LLMEngine

    warn_if_busy("generate", adapts=not args.fixed_threads, device=args.device)
    engine = LLMEngine(config)
    try:
        return _generate(engine, args, prompts, params)
    finally:
        engine.close()  # the other tensor-parallel ranks, if any


def _generate(engine, args: argparse.Namespace, prompts: list, params) -> int:
    """The prompts run on ``engine``, printed (or as JSON lines), then the stats; the exit
    code."""
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompts = [
            engine.tokenizer.encode_chat([*system, {"role": "user", "content": p}]) for p in prompts
        ]
    # Every prompt is checked before any runs: a request that can never run (context, KV
    # pool) is the user's to fix, answered like any other bad input.
    prompts = [p if isinstance(p, list) else engine.tokenizer.encode(p) for p in prompts]
    for i, ids in enumerate(prompts):  # token ids from here on: each prompt is encoded once
        try:
            engine.check_request(ids, params)
        except UsageError as exc:
            raise UsageError(f"PROMPT {i + 1}: {exc}", exc.param, exc.code) from None
    if len(prompts) == 1 and params.n == 1 and not args.json:
        for delta, out in engine.stream(prompts[0], params):
            sys.stdout.write(delta)
            sys.stdout.flush()
            outputs = [out]
        sys.stdout.write("\n")
    else:
        outputs = run_batch(engine, prompts, params, "pagedkv generate")
        for i, out in enumerate(outputs):
            if args.json:
                print(json.dumps(_as_json(out, engine.info), ensure_ascii=False))
                continue
            for c in out.outputs:
                label = f"[{i}]" if params.n == 1 else f"[{i}.{c.index}]"
                body = out.error if out.error else c.text.strip()
                print(f"{label} ({c.finish_reason}) {body}")
    if not args.json:
        print_stats(engine.stats(), title=f"pagedkv generate — policy {engine.info.policy}")
    errors = sum(1 for o in outputs if o.error)
    return 1 if errors == len(outputs) else 0


def _as_json(out, info) -> dict:
    """One request's JSON line; with partial-block reuse on (a prefix match unit below the
    block size) its ``cached_tokens`` split: from a partially matched block, and the KV bytes
    copied for it."""
    partial = {}
    if (info.prefix_match_unit or info.block_size) < info.block_size:
        partial = {
            "partial_cached_tokens": out.num_partial_cached_tokens,
            "prefix_copied_bytes": out.num_prefix_copied_tokens * info.record_bytes,
        }
    return {
        "request_id": out.request_id,
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
        **partial,
        "error": out.error,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "logprobs": c.logprobs,
            }
            for c in out.outputs
        ],
    }
