"""`pagedkv profile --timeline`: where one engine step's time goes, phase by phase.

Runs ``--requests`` requests (random prompt ids of 16-``--max-prompt`` tokens, 8-64 new tokens
each, seeded, all at t = 0, EOS ignored) through one engine with a ``StepTimeline`` attached
(``engine/step/timeline.py``), then prints, per kind of step (prefill, mixed, decode), the median
wall time of a step, of each host phase (they tile the step) and, on a GPU, of the forward
pass itself (CUDA events), and writes every step's record to ``--output``. The phases add up to
each step's wall time; on a GPU the forward's own time beside them shows what the host hides.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from pagedkv.errors import UsageError

MAX_NEW_TOKENS = 64


def run_timeline(args: argparse.Namespace, base) -> int:
    """The timeline run (``base``: the ``EngineConfig`` the flags give)."""
    import dataclasses

    from pagedkv.engine import LLMEngine

    num_requests = 32 if args.requests is None else args.requests
    max_prompt = 512 if args.max_prompt is None else args.max_prompt
    if num_requests < 1:
        raise UsageError(f"--requests must be >= 1, got {num_requests}", "requests")
    if max_prompt < 16:
        raise UsageError(f"--max-prompt must be >= 16, got {max_prompt}", "max_prompt")
    config = dataclasses.replace(base, log_startup=False, async_scheduling=args.async_scheduling)
    engine = LLMEngine(config)
    try:
        return _timeline(engine, args, num_requests, max_prompt)
    finally:
        engine.close()


def _timeline(engine, args: argparse.Namespace, num_requests: int, max_prompt: int) -> int:
    """The timeline's requests run on ``engine``, and its report."""
    from pagedkv.engine.step.timeline import StepTimeline, summarize

    if max_prompt + MAX_NEW_TOKENS > engine.max_model_len:
        raise UsageError(
            f"--max-prompt {max_prompt} + up to {MAX_NEW_TOKENS} new tokens is more "
            f"than the model's context ({engine.max_model_len} tokens)",
            "max_prompt",
        )
    prompts, params = _workload(args.seed, num_requests, max_prompt, engine.info.vocab_size)
    engine.generate(prompts[:1], params[:1])  # warm-up: kernels compiled, caches touched
    timeline = StepTimeline(engine.runner.device)
    engine.attach_timeline(timeline)
    engine.generate(prompts, params)
    records = timeline.records()
    summary = summarize(records)
    _print_summary(len(records), summary)
    Path(args.output).write_text(
        json.dumps(
            {
                "device": str(engine.runner.device),
                "async_scheduling": engine.steps_ahead,
                "summary": summary,
                "steps": [r.to_dict() for r in records],
            },
            indent=1,
        )
    )
    print(f"wrote {args.output}")
    return 0


def _workload(seed: int, num_requests: int, max_prompt: int, vocab: int) -> tuple[list, list]:
    """Seeded random prompts of 16 to ``max_prompt`` ids, and 8 to ``MAX_NEW_TOKENS`` new
    tokens each (EOS ignored): (prompts, their ``SamplingParams``)."""
    from pagedkv.engine import SamplingParams

    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(num_requests):
        length = rng.randrange(16, max_prompt + 1)
        prompts.append([rng.randrange(vocab) for _ in range(length)])
    new_tokens = [rng.randrange(8, MAX_NEW_TOKENS + 1) for _ in prompts]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in new_tokens]
    return prompts, params


def _print_summary(num_steps: int, summary: dict) -> None:
    """One row per kind of step: median wall time, each phase's, the GPU forward's (ms)."""
    from rich.console import Console
    from rich.table import Table

    from pagedkv.engine.step.timeline import PHASES

    table = Table(title=f"pagedkv step timeline ({num_steps} steps; median ms)")
    for column in ("kind", "steps", "wall", *PHASES, "GPU forward"):
        table.add_column(column, justify="right")
    for kind, row in summary.items():
        gpu = row.get("gpu_forward_s")
        table.add_row(
            kind,
            str(row["steps"]),
            f"{row['wall_s'] * 1e3:.2f}",
            *(f"{row['phases_s'][p] * 1e3:.2f}" for p in PHASES),
            "-" if gpu is None else f"{gpu * 1e3:.2f}",
        )
    Console().print(table)
