"""`pagedkv profile` and its engine-side timing: the shapes noted are what the engine ran, and
the profile it writes is one the simulator accepts."""

from __future__ import annotations

import json
import re

import pytest

from pagedkv import cli
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.profiling import StepRecorder, step_shape
from pagedkv.engine.startup import build_parts
from pagedkv.kvcache.policies import get_policy
from pagedkv.model import load_model
from pagedkv.sched import SchedulerConfig
from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.costs.profiled import read_cost_profile
from pagedkv.sim.simulator import Simulation
from pagedkv.traces import FreshSegments, TraceRequest
from tests.model.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", folder)
    return folder


def test_step_shape_counts_a_mixed_batch_by_hand():
    # A 5-token prompt from scratch and one decode after 10 cached tokens, blocks of 4.
    batch = ScheduledBatch(0, (ScheduledSeq(None, 0, 5, 1, 0), ScheduledSeq(None, 10, 1, 1, 0)))
    shape = step_shape(batch, 4)
    # tokens 5+1; context 5 + 11; pairs 5*6/2 + (10 + 1); blocks ceil(5/4) + ceil(11/4);
    # the decode attends to 11 tokens
    assert shape == StepShape(6, 16, 26, 2, 1, 2 + 3, 4, 11)


def test_the_recorder_refuses_an_engine_one_step_ahead(tiny_folder):
    # One step ahead, a call returns the previous batch's tokens: its time is no batch's.
    loaded = load_model(tiny_folder, progress=False)
    config = EngineConfig(model=str(tiny_folder), async_scheduling=True, log_startup=False)
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    with pytest.raises(ValueError, match="async_scheduling=False"):
        StepRecorder(engine)


def test_the_recorder_notes_each_step_the_engine_ran(tiny_folder):
    loaded = load_model(tiny_folder, progress=False)
    config = EngineConfig(model=str(tiny_folder), block_size=4, log_startup=False)
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    rec = StepRecorder(engine)
    engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=3, ignore_eos=True), "r")
    shapes = []
    while engine.has_unfinished():
        outputs = rec.step()
        assert rec.last is not None and rec.last.seconds > 0
        shapes.append(rec.last.shape)
        assert rec.last_running == 1  # counted before the last step's update finished it
    assert [o.request_id for o in outputs] == ["r"] and outputs[0].finished
    assert "r" in rec.first_token_s
    # The 10-token prompt (3 blocks of 4), then two decodes at contexts 11 and 12.
    assert shapes == [
        StepShape(10, 10, 55, 1, 0, 3, 4),
        StepShape(1, 11, 11, 1, 1, 3, 4, 11),
        StepShape(1, 12, 12, 1, 1, 3, 4, 12),
    ]


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_profile_quick_writes_a_profile_the_simulator_accepts(tiny_folder, tmp_path, capsys, clock):
    out = tmp_path / "profile.json"
    flags = ["--quick", "--model", str(tiny_folder), "-o", str(out), "--clock", clock]
    code = cli.main(["profile", *flags, "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr()
    assert "wrote" in printed.out and "points done" not in printed.out
    # Progress on stderr, a line per grid point where no live bar can show (not a terminal).
    assert re.search(r"^pagedkv profile: (\d+)/\1 points done, ", printed.err, re.M), printed.err
    data = json.loads(out.read_text())
    assert data["model"] == str(tiny_folder) and data["block_sizes"] == [16]
    assert data["threads"] == 1 and data["torch"] and data["clock"] == clock
    profile = read_cost_profile(out)
    shapes = [s.shape for s in profile.samples]
    # --quick: prompts of 8 and 32 alone, then 2 prompts of ~16 decoded at batch 2 and 1.
    assert StepShape(8, 8, 36, 1, 0, 1, 16) in shapes
    assert StepShape(32, 32, 528, 1, 0, 2, 16) in shapes
    decodes = [s for s in shapes if s.num_decode_seqs == s.num_seqs]
    assert sorted({s.num_seqs for s in decodes}) == [1, 2]
    assert all(s.seconds > 0 for s in profile.samples)
    cost = profile.cost_model()
    fresh = FreshSegments()
    requests = [TraceRequest(0.0, fresh.take(30), 5), TraceRequest(0.01, fresh.take(12), 4)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    run = Simulation(requests, get_policy("vllm"), 128, config, cost).run()
    assert run.duration_s > 0 and all(r.finish_s for r in run.records)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-sizes", "0,2"], "--batch-sizes: every value must be >= 1"),
        (["--block-sizes", "a"], "--block-sizes: expected comma-separated integers"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["-o", "/no/such/folder/p.json"], "not a file in an existing folder"),
        (["--clock", "cpu", "--threads", "2"], "--clock cpu needs --threads 1"),
    ],
)
def test_bad_flags_are_one_line_before_any_work(flags, message, capsys):
    assert cli.main(["profile", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_grid_beyond_the_model_context_is_refused(tiny_folder, tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["profile", "--model", str(tiny_folder), "--prefill-lens", "200", "-o", str(out)]
    assert cli.main(args) == 2
    assert "exceeds the model's context of 128" in capsys.readouterr().err
    assert not out.exists()
