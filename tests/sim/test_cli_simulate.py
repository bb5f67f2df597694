"""`pagedkv simulate` from the command line: JSON fields, table, plot, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.cli import main

REQUIRED = {
    "policy", "block_size", "num_requests", "prompt_tokens", "prefix_hit_tokens", "peak_running",
    "mean_running", "kv_utilization_mean", "preemptions", "refused", "throughput_tokens_per_s",
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
}  # fmt: skip
SMALL = [
    "--synthetic",
    "requests=12,prompt=100-900,output=5-40,system=256",
    "--max-model-len",
    "2k",
]


def test_json_has_one_object_per_run_with_the_documented_fields(capsys) -> None:
    code = main(
        ["simulate", *SMALL, "--policy", "reserved,vllm,sglang", "--block-sizes", "16,32",
         "--kv-memory", "2GiB", "--json"]
    )  # fmt: skip
    assert code == 0
    runs = json.loads(capsys.readouterr().out)
    names = [(r["policy"], r["block_size"]) for r in runs]
    assert names == [("reserved", 2048), ("vllm@16", 16), ("vllm@32", 32), ("sglang@16", 16),
                     ("sglang@32", 32)]  # fmt: skip
    for r in runs:
        assert r.keys() >= REQUIRED
        assert r["num_requests"] == 12 and r["refused"] == 0
    # 2 GiB / 128 KiB = 16384 slots = 8 regions of 2048 for the reserved baseline.
    assert runs[0]["peak_running"] == 8 and runs[0]["num_kv_slots"] == 16384
    assert all(r["prefix_hit_tokens"] > 0 for r in runs[1:])  # the shared system prompt


def test_table_and_plot(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    assert main(["simulate", *SMALL, "--policy", "vllm", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "peak run" in out and "vllm" in out
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "exactly one of --trace FILE or --synthetic SPEC"),
        ([*SMALL, "--policy", "vllm,nope"], "unknown policy 'nope'"),
        ([*SMALL, "--kv-memory", "lots"], "--kv-memory"),
        ([*SMALL, "--gpu", "TPU"], "unknown GPU 'TPU'"),
        ([*SMALL, "--block-sizes", "16,x"], "--block-sizes"),
        (["--synthetic", "requests=1,colour=red"], "synthetic spec"),
        (["--trace", "/nonexistent/trace.jsonl"], "no trace file"),
        (
            [*SMALL, "--kv-memory", "100MiB", "--policy", "reserved"],
            "cannot hold one max_model_len",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_runs_are_identical_across_processes_with_different_hash_seeds() -> None:
    """Nothing in a replay may depend on Python's salted hash() or set order."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "pagedkv", "simulate", "--synthetic",
            "requests=30,prompt=100-900,output=5-60,system=300,turns=3,rate=50",
            "--max-model-len", "4k", "--kv-memory", "200MiB", "--policy", "vllm,sglang",
            "--json"]  # fmt: skip
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        runs = json.loads(done.stdout)
        for r in runs:
            del r["wall_time_s"]
        outs.append(runs)
    assert outs[0] == outs[1] and outs[0][0]["preemptions"] > 0
