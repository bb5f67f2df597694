"""`pagedkv simulate --replicas N --router ...`: per-replica rows, JSON fields, one-line errors."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main

SMALL = [
    "--synthetic", "requests=16,prompt=100-900,output=5-40,system=256,turns=2,gap=1",
    "--max-model-len", "2k", "--kv-memory", "1GiB", "--policy", "vllm",
]  # fmt: skip


def test_table_has_totals_and_one_row_per_replica(capsys) -> None:
    assert main(["simulate", *SMALL, "--replicas", "2", "--router", "prefix-aware"]) == 0
    out = capsys.readouterr().out
    assert "imbalance" in out and "of ceiling" in out and "per replica" in out
    rows = [line for line in out.splitlines() if line.startswith("│ r")]
    assert [line.split()[1] for line in rows] == ["r0", "r1"]


def test_json_has_one_object_per_router_with_replicas(capsys) -> None:
    argv = ["simulate", *SMALL, "--replicas", "3", "--router", "round-robin,prefix-aware"]
    assert main([*argv, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [r["router"] for r in runs] == ["round-robin", "prefix-aware"]
    for r in runs:
        assert r["num_replicas"] == 3 and len(r["replicas"]) == 3
        assert sum(x["num_requests"] for x in r["replicas"]) == r["num_requests"] == 32
        assert r["load_imbalance"] >= 1.0 and 0 < r["prefix_hit_of_ideal"] <= 1
        assert sum(r["routing_decisions"].values()) == 32
    assert runs[0]["routing_decisions"] == {"rotation": 32}


def test_one_replica_with_a_router_is_the_one_engine_run(capsys) -> None:
    assert main(["simulate", *SMALL, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)[0]
    assert main(["simulate", *SMALL, "--router", "prefix-aware", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)[0]
    for key in ("prefix_hit_tokens", "ttft_p50_s", "ttft_p99_s", "num_steps", "duration_s"):
        assert got[key] == one[key], key


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--replicas", "two"], "--replicas: expected a whole number"),
        (["--replicas", "2", "--router", "random"], "unknown routing policy 'random'"),
        (["--replicas", "2", "--router", ","], "--router: name at least one"),
        (["--replicas", "2", "--balance-rel", "-1"], "--balance-rel: must be >= 0"),
        (["--replicas", "2", "--balance-abs", "x"], "--balance-abs"),
        (["--replicas", "2", "--plot", "x.png"], "--plot draws one engine's runs"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(args, message, capsys) -> None:
    assert main(["simulate", *SMALL, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
