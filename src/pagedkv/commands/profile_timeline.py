"""`pagedkv profile --timeline`: where one engine step's time goes, phase by phase.

Runs ``--requests`` requests (random prompt ids of 16-``--max-prompt`` tokens, 8-64 new tokens
each, seeded, all at t = 0, EOS ignored) through one engine with a ``StepTimeline`` attached
(``engine/timeline.py``), then prints, per kind of step (prefill, mixed, decode), the median
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


def run_timeline(args: argparse.Namespace, base) -> int:
    """The timeline run (``base``: the ``EngineConfig`` the flags give)."""
    import dataclasses

    from rich.console import Console
    from rich.table import Table

    from pagedkv.engine import LLMEngine, SamplingParams
    from pagedkv.engine.timeline import PHASES, StepTimeline, summarize

    if args.requests < 1 or args.max_prompt < 16:
        raise UsageError("--requests must be >= 1 and --max-prompt >= 16", "requests")
    config = dataclasses.replace(base, log_startup=False, async_scheduling=args.async_scheduling)
    engine = LLMEngine(config)
    rng = random.Random(args.seed)
    vocab = engine.info.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(16, args.max_prompt + 1))]
               for _ in range(args.requests)]  # fmt: skip
    params = [SamplingParams(max_tokens=rng.randrange(8, 65), ignore_eos=True) for _ in prompts]
    engine.generate(prompts[:1], params[:1])  # warm-up: kernels compiled, caches touched
    timeline = StepTimeline(engine.runner.device)
    engine.attach_timeline(timeline)
    engine.generate(prompts, params)
    records = timeline.records()
    summary = summarize(records)
    table = Table(title=f"pagedkv step timeline ({len(records)} steps; median ms)")
    for column in ("kind", "steps", "wall", *PHASES, "GPU forward"):
        table.add_column(column, justify="right")
    for kind, row in summary.items():
        gpu = row.get("gpu_forward_s")
        table.add_row(kind, str(row["steps"]), f"{row['wall_s'] * 1e3:.2f}",
                      *(f"{row['phases_s'][p] * 1e3:.2f}" for p in PHASES),
                      "-" if gpu is None else f"{gpu * 1e3:.2f}")  # fmt: skip
    Console().print(table)
    Path(args.output).write_text(json.dumps(
        {"device": str(engine.runner.device), "async_scheduling": engine._ahead is not None,
         "summary": summary, "steps": [r.to_dict() for r in records]}, indent=1))  # fmt: skip
    print(f"wrote {args.output}")
    return 0
