"""`pagedkv plan` at the CLI edge: errors are one line with exit 2; table, JSON and plot."""

from __future__ import annotations

import json

import pytest

from tests.planner.helpers import plan_json, rows_by_block_size, run_plan

BASE = ("--record-bytes", "4096", "--num-seqs", "128", "--max-len", "8192")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((*BASE, "--block-sizes", "0,16"), "block sizes must be >= 1"),
        ((*BASE, "--block-sizes", "8,x"), "--block-sizes: expected comma-separated integers"),
        (
            ("--record-bytes", "4096", "--num-seqs", "0", "--max-len", "8"),
            "num_seqs (K) must be >= 1",
        ),
        (("--record-bytes", "4096", "--max-len", "8"), "give --num-seqs K"),
        (
            ("--record-bytes", "4096", "--num-seqs", "-3", "--max-len", "8"),
            "--num-seqs: expected a whole number",
        ),
        (
            ("--model", "llama-9", "--num-seqs", "1", "--max-len", "8"),
            "unknown model preset 'llama-9'",
        ),
        (
            ("--model", "/nonexistent/config.json", "--num-seqs", "1", "--max-len", "8"),
            "cannot read",
        ),
        (("--num-seqs", "1", "--max-len", "8"), "give exactly one of --model"),
        (("--model", "llama-3-8b", *BASE), "give exactly one of --model"),
        (
            ("--model", "llama-3-8b", "--kv-dtype", "int2", "--num-seqs", "1", "--max-len", "8"),
            "unknown KV dtype",
        ),
        ((*BASE, "--kv-dtype", "fp8"), "--kv-dtype needs --model"),
        ((*BASE, "--prefix-len", "8", "--prefix-hits", "x"), "--prefix-hits: expected a whole"),
        ((*BASE, "--backend", "cudnn"), "unknown attention backend 'cudnn'"),
        ((*BASE, "--memory", "58XB"), "--memory: expected a size"),
        ((*BASE, "--prefix-range", "10:5"), "--prefix-range: need 0 < A <= B"),
        ((*BASE, "--prefix-len", "10", "--prefix-range", "1:5"), "not both"),
        (
            ("--record-bytes", "4096", "--num-seqs", "1", "--trace", "/nonexistent.csv"),
            "no trace file",
        ),
        (("--record-bytes", "1", "--num-seqs", "1", "--trace", "t.csv", "--max-len", "8"), "drop"),
        (
            ("--record-bytes", "0", "--num-seqs", "1", "--max-len", "8"),
            "--record-bytes must be >= 1",
        ),
        (("--record-bytes", "4096", "--num-seqs", "1"), "--mean-len"),
        ((*BASE, "--gpu-memory", "80GiB"), "--gpu-memory needs --weights"),
        (
            ("--model", "llama-3-8b", "--num-seqs", "1", "--max-len", "8", "--gpu-memory", "10GB"),
            "no memory left",
        ),
        ((*BASE, "--gpu", "H100-80GB"), "--gpu prices the model's layers: give --model"),
        (
            ("--model", "llama-3-8b", "--num-seqs", "1", "--max-len", "8", "--gpu", "V100"),
            "unknown GPU 'V100'",
        ),
    ],
)
def test_invalid_input_is_one_error_line_and_exit_2(args, message):
    code, out, err = run_plan(*args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("pagedkv plan: error: ")
    assert message in err


def test_bad_config_file_is_one_error_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{oops")
    code, _, err = run_plan("--model", str(bad), "--num-seqs", "1", "--max-len", "8")
    assert code == 2 and err.count("\n") == 1 and "cannot read model config" in err


def test_table_output_names_the_recommendation_and_units():
    code, out, err = run_plan(*BASE, "--prefix-len", "1200", "--block-sizes", "8,16,32")
    assert code == 0 and err == ""
    assert "MB = 10^6 B, KiB = 1024 B" in out
    assert "recommended block size: 8" in out
    assert "time ledger" in out
    assert "resolved: block_size=8 tokens (backend torch-sdpa)" in out


def test_json_carries_the_documented_fields():
    report = plan_json(*BASE, "--prefix-len", "1200", "--memory", "1GiB")
    required = {"block_size", "table_entries", "table_bytes", "internal_fragmentation_bytes",
                "prefix_reuse_rate", "prefix_waste_bytes", "total_bytes", "allowed"}  # fmt: skip
    for row in report["rows"]:
        assert required <= set(row)
    assert report["recommendation"]["block_size"] == 8
    assert report["recommendation"]["resolution"] == "block_size=8 tokens (backend torch-sdpa)"
    assert report["capacity"]["pool_bytes"] == 2**30


def test_backend_constraints_drive_the_recommendation():
    report = plan_json("--model", "deepseek-v3", "--num-seqs", "64", "--max-len", "4096",
                       "--backend", "flashmla")  # fmt: skip
    rows = rows_by_block_size(report)
    assert [b for b, r in rows.items() if r["allowed"]] == [64]
    assert rows[16]["violations"] == ["flashmla supports block sizes 64 only"]
    assert report["recommendation"]["block_size"] == 64
    assert any("excluded by hard constraints" in r for r in report["recommendation"]["reasons"])


def test_no_allowed_candidate_is_reported_not_invented():
    report = plan_json("--model", "llama-3-8b", "--num-seqs", "4", "--max-len", "512",
                       "--backend", "fa4", "--block-sizes", "16,32")  # fmt: skip
    assert report["recommendation"]["block_size"] is None
    assert "no candidate is allowed by backend fa4" in report["recommendation"]["reasons"][0]


def test_short_prefix_warning():
    # P = 40 tokens can never fill a 64-token block: a prefix cache at B >= 64 never hits.
    report = plan_json(*BASE, "--prefix-len", "40", "--block-sizes", "64,128")
    assert rows_by_block_size(report)[64]["prefix_reuse_rate"] == 0
    assert rows_by_block_size(report)[64]["prefix_shorter_than_block"] is True
    (warning,) = report["recommendation"]["warnings"]
    assert "shorter than one block of 64" in warning


def test_plot_is_written(tmp_path):
    png = tmp_path / "plan.png"
    code, out, _ = run_plan(*BASE, "--prefix-range", "64:256", "--plot", str(png))
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in out


def test_unwritable_plot_path_is_one_error_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_plan(*BASE, "--plot", str(blocker / "sub" / "plan.png"))
    assert code == 2 and err.count("\n") == 1 and "--plot: cannot create the folder" in err


HUGE = "9" * 400


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((*BASE, "--memory", HUGE + "TiB"), "--memory: "),
        ((*BASE, "--memory", "nanGiB"), "--memory: expected a size"),
        ((*BASE, "--swap-bytes", HUGE), "--swap-bytes: "),
        (("--record-bytes", "4096", "--num-seqs", "²", "--max-len", "8"),
         "--num-seqs: expected a whole number written with digits 0-9, got '²'"),
        (("--record-bytes", "4096", "--num-seqs", HUGE, "--max-len", "8"), "--num-seqs: "),
        (("--record-bytes", "4096", "--num-seqs", "1", "--max-len", HUGE), "--max-len: "),
        ((*BASE, "--prefix-len", "9000"),
         "--prefix-len: a 9000-token prefix is longer than the sequence (max length 8192"),
        ((*BASE, "--prefix-range", "1:50000000"), "--prefix-range: B = 50000000 tokens is longer"),
        (("--record-bytes", "4096", "--num-seqs", "1", "--max-len", "64000000",
          "--prefix-range", "1:50000000"), "--prefix-range: at most 262,144 values"),
        ((*BASE, "--block-sizes", "16," + HUGE), "--block-sizes: "),
    ],
)  # fmt: skip
def test_hostile_numbers_are_one_line_fast(args, message):
    code, out, err = run_plan(*args)  # --prefix-range 1:50000000 used to exhaust memory
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and message in err, err


def test_sizes_are_exact_and_the_pool_may_be_large():
    # 0.1 GiB is computed exactly: round(0.1 * 2**30) = 107374182 (a float would give the same
    # here; the point is that a 40-digit size no longer overflows on the way).
    assert plan_json(*BASE, "--memory", "0.1GiB")["capacity"]["pool_bytes"] == 107_374_182
    assert plan_json(*BASE, "--memory", "1000000TiB")["capacity"]["pool_bytes"] == 10**6 * 2**40


def _trace(tmp_path, lines: list[str], name: str = "t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_bad_trace_record_is_skipped_with_a_warning_unless_strict(tmp_path):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}'
    bad = '{"timestamp": 1, "input_length": 600, "output_length": 1e400, "hash_ids": [0, 1]}'
    path = _trace(tmp_path, [good, bad])
    args = ("--record-bytes", "8", "--num-seqs", "2", "--trace", str(path), "--json")
    code, out, err = run_plan(*args)
    assert code == 0 and f"{path}:2: cannot parse a Mooncake record: output_length" in err
    assert "warning: skipped 1 unparsable line(s)" in err
    assert '"max_len_tokens": 604' in out
    code, out, err = run_plan(*args, "--strict")
    assert code == 2 and out == "" and err.count("\n") == 1 and f"{path}:2: " in err


def test_a_negative_azure_context_is_skipped_not_priced(tmp_path):
    path = _trace(tmp_path, ["TIMESTAMP,ContextTokens,GeneratedTokens",
                             "2023-11-16 18:15:46.0,100,10", "2023-11-16 18:15:47.0,-50,10"],
                  "a.csv")  # fmt: skip
    code, out, err = run_plan("--record-bytes", "8", "--num-seqs", "2", "--trace", str(path),
                              "--json")  # fmt: skip
    assert code == 0 and f"{path}:3: " in err and "ContextTokens must be in [1, " in err
    workload = json.loads(out)["workload"]
    assert (workload["mean_len_tokens"], workload["max_len_tokens"]) == (110, 110)


def test_gpu_prices_a_decode_step_per_block_size_and_weighs_it():
    args = ("--model", "llama-3-8b", "--num-seqs", "64", "--mean-len", "1024", "--max-len",
            "4096", "--prefix-len", "600", "--block-sizes", "1,2,4,16,64", "--gpu", "H100-80GB")  # fmt: skip
    report = plan_json(*args)
    rows = rows_by_block_size(report)
    times = [rows[b]["decode_step_ms"] for b in (1, 2, 4, 16)]
    assert times == sorted(times, reverse=True)  # small blocks walk more: slower steps
    # 64 sequences x 1,024 tokens x 128 KiB of KV, plus 16 GB of weights: at least their bytes
    # over the H100's peak 3.35 TB/s
    floor_ms = (64 * 1024 * 131072 + 16.06e9) / 3.35e12 * 1e3
    assert all(t > floor_ms for t in times)
    # B = 1 has the least W(B) here (no fragmentation) but a slower step: it is left out, and
    # the choice is the least W among the B whose step is within 5 % of the fastest
    assert rows[1]["total_bytes"] == min(r["total_bytes"] for r in rows.values())
    chosen = report["recommendation"]["block_size"]
    fastest = min(r["decode_step_ms"] for r in rows.values())
    assert chosen != 1 and rows[chosen]["decode_step_ms"] <= 1.05 * fastest
    for b, r in rows.items():
        if r["total_bytes"] < rows[chosen]["total_bytes"]:
            assert r["decode_step_ms"] > 1.05 * fastest, b
    assert any(
        "left out for time" in r and "B=1 " in r for r in report["recommendation"]["reasons"]
    )
    without = plan_json(*args[:-2])
    assert without["recommendation"]["block_size"] == 1
    assert all(r["decode_step_ms"] is None for r in without["rows"])
