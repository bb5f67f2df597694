"""``StepTimeline`` (``engine/step/timeline.py``) and ``pagedkv profile --timeline``: every step's
phases tile it, so they add up to its wall time, synchronous and one step ahead; the phases a
kind of step must pass through are there; the steps' wall times fit inside the time the caller
measured around them."""

from __future__ import annotations

import json
import time

import pytest

from pagedkv import cli
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.engine.step.timeline import PHASES, StepTimeline, summarize

from ..test_swap_engine import PROMPTS


@pytest.mark.parametrize("ahead", [False, True])
def test_the_phases_add_up_to_each_steps_wall_time(tiny_long, ahead):
    config = EngineConfig(log_startup=False, max_model_len=256, kv_cache_memory_bytes=1 << 20,
                          max_num_batched_tokens=64, async_scheduling=ahead)  # fmt: skip
    engine = LLMEngine(config, parts=build_parts(config, tiny_long))
    timeline = StepTimeline(engine.runner.device)
    engine.attach_timeline(timeline)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    outside = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        outside.append(time.perf_counter() - t0)
    steps = timeline.records()
    assert len(steps) == len(outside)
    for step, around in zip(steps, outside, strict=True):
        assert sum(step.phases_s.values()) == pytest.approx(step.wall_s, rel=1e-9, abs=1e-12)
        assert set(step.phases_s) <= set(PHASES) and min(step.phases_s.values()) >= 0
        assert step.wall_s <= around  # inside the call
        assert step.gpu_forward_s is None  # the CPU: no CUDA events
    kinds = summarize(steps)
    assert {"mixed", "decode"} <= set(kinds) or {"prefill", "decode"} <= set(kinds)
    computing = [s for s in steps if s.num_tokens]
    assert all({"schedule", "prepare", "forward"} <= set(s.phases_s) for s in computing)
    # A synchronous step draws and records its own tokens; one ahead, the previous step's
    # (every call but the first).
    recording = computing if not ahead else steps[1:]
    assert all({"sample", "record", "update"} <= set(s.phases_s) for s in recording)


def test_profile_timeline_writes_every_step(tmp_path, capsys):
    out = tmp_path / "timeline.json"
    argv = ["profile", "--timeline", "--requests", "3", "--max-prompt", "24", "-o", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["steps"] and data["device"] == "cpu" and not data["async_scheduling"]
    assert "decode" in data["summary"]
    assert "pagedkv step timeline" in capsys.readouterr().out
