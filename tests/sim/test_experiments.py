"""`pagedkv experiment` and the block-size sweep: the grid, one point against hand bounds, the
direction of the block-size effect, the registry's errors, and the files it writes."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.commands import experiment as command
from pagedkv.errors import UsageError
from pagedkv.sim.experiments import block_size as bs


def test_the_grid_is_every_block_size_for_every_workload_and_rate() -> None:
    pts = bs.points(quick=True)
    assert {p.block_size for p in pts} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert {p.workload for p in pts} == {"sharegpt", "alpaca"}
    assert len(pts) == 9 * sum(len(r) for r in bs.RATES_PER_S.values())


def test_one_point_is_no_faster_than_reading_the_weights_per_token() -> None:
    row = bs.run_point(bs.Point("alpaca", 10.0, 16, 40))
    # every output token takes at least one step; a step reads OPT-13B's 25.7 GB of fp16
    # weights, which no kernel does faster than the A100-40GB's peak 1.555 TB/s (16.5 ms)
    floor_s = 2 * 12_853_473_280 / 1.555e12
    assert row["normalized_latency_s_per_token"] >= floor_s
    assert row["num_refused"] == 0 and row["workload"] == "alpaca" and row["block_size"] == 16


def test_short_requests_suffer_from_big_blocks_and_tiny_blocks() -> None:
    lat = {
        b: bs.run_point(bs.Point("alpaca", 70.0, b, 400))["normalized_latency_s_per_token"]
        for b in (1, 16, 256)
    }
    # B=256: each ~80-token request holds a 256-slot block (a third of the pool's sequences)
    # and its whole tail is read; B=1: one kernel iteration per token
    assert lat[256] > 1.5 * lat[16]
    assert lat[1] > 1.5 * lat[16]


@pytest.mark.parametrize(("workload", "rate"), [("sharegpt", 1.5), ("alpaca", 30.0)])
def test_blocks_of_one_and_two_tokens_are_clearly_worse_than_sixteen(workload, rate) -> None:
    """The paper's §7.2 finding on the fitted clock, at each workload's lightest rate."""
    lat = {
        b: bs.run_point(bs.Point(workload, rate, b, 150))["normalized_latency_s_per_token"]
        for b in (1, 2, 16)
    }
    assert lat[1] > lat[2] > 1.15 * lat[16]


def test_best_block_sizes_by_hand() -> None:
    rows = [
        {"workload": "alpaca", "rate_per_s": 30.0, "block_size": b, "normalized_latency_s_per_token": v}
        for b, v in ((8, 0.0210), (16, 0.0200), (32, 0.0209), (64, 0.0211))
    ]  # fmt: skip
    assert bs.best_block_sizes(rows)["alpaca"]["30"] == {"best": 16, "within_5%": [8, 16, 32]}


def test_registry_names_both_experiments_and_refuses_others() -> None:
    assert set(command.EXPERIMENTS) >= {"block-size", "preemption"}
    with pytest.raises(UsageError, match="unknown experiment 'nope'"):
        command.load_experiment("nope")


def test_a_missing_experiment_module_is_one_usage_error(monkeypatch) -> None:
    monkeypatch.setitem(command.EXPERIMENTS, "ghost", "ghost_not_built")
    with pytest.raises(UsageError, match="'ghost' is not built"):
        command.load_experiment("ghost")


def test_command_writes_the_json_and_the_figure(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(bs, "RATES_PER_S", {"alpaca": (20.0, 40.0)})
    monkeypatch.setattr(bs, "BLOCK_SIZES", (16, 256))
    monkeypatch.setattr(bs, "QUICK_NUM_REQUESTS", {"alpaca": 20})
    monkeypatch.setattr(bs, "PREFIX_RATES_PER_S", {"vllm-class": (1.0,)})
    monkeypatch.setattr(bs, "QUICK_PREFIX_NUM_REQUESTS", 20)
    code = main(["experiment", "block-size", "--quick", "--workers", "1", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "experiments" / "block-size.json").read_text())
    assert len(result["points"]) == 4 and result["quick"] is True
    shared = result["partial_reuse"]["points"]  # B = 16 and 256, whole blocks and U = 1
    grid = [(16, None), (16, 1), (256, None), (256, 1)]
    assert [(r["block_size"], r["prefix_match_unit"]) for r in shared] == grid
    assert result["setup"]["kv_pool_slots"] == 12 * 2**30 // 819_200  # the paper's 15.7K
    assert (tmp_path / "img" / "block-size.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["experiment", "nope"], "unknown experiment 'nope'"),
        (["experiment", "block-size", "--workers", "0"], "--workers"),
    ],
)
def test_bad_arguments_are_one_line(argv, words, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_partial_reuse_recovers_the_system_prompts_a_large_block_loses() -> None:
    """Shared system prompts of 32-480 tokens: at B = 256 whole blocks reuse only prompts of
    256 tokens or more, rounded down; one-token units reuse every one of them, to the token."""

    def point(unit):
        p = bs.Point("sharegpt", 1.0, 256, 60, prefix_match_unit=unit, shared_prefixes=True)
        return bs.run_point(p)

    whole, partial = point(None), point(1)
    assert partial["prefix_hit_tokens"] > 1.5 * whole["prefix_hit_tokens"]
    assert partial["prefix_copy_time_s"] > 0 and whole["prefix_copy_time_s"] == 0
    assert partial["num_refused"] == whole["num_refused"]
