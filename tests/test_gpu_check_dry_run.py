"""``benchmarks/gpu_check.py --dry-run``: the device check's code, on this CPU under Triton's
interpreter at tiny sizes, so the one command a lent GPU machine runs cannot rot. Checks what
the run records (every section, no error, the kernels within tolerance, greedy tokens equal),
never how fast anything was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("kernels", "greedy", "ledger", "engine", "profile_sim")
# A few rows in the Azure conversation trace's format: the test needs no shared trace.
TRACE_ROWS = [(374, 44), (396, 109), (879, 55), (91, 16)]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(the JSON, stdout) of one dry run."""
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")  # transformers' GGUF loading, and the truncated copy
    tmp = tmp_path_factory.mktemp("gpu_check")
    trace = tmp / "trace.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{i:02d}.0,{p},{o}\n" for i, (p, o) in enumerate(TRACE_ROWS))
    )
    output = tmp / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--output", str(output),
         "--trace", str(trace)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(output.read_text()), proc.stdout


def test_every_section_ran_without_error(dry_run):
    result, _ = dry_run
    assert list(result["sections"]) == list(SECTIONS)
    for name, entry in result["sections"].items():
        assert entry["ok"], f"{name}: {entry['error']}\n{entry.get('traceback', '')}"
        assert entry["error"] is None and entry["wall_s"] >= 0
    meta = result["meta"]
    assert meta["dry_run"] and meta["device_name"] == "cpu"
    assert meta["versions"]["torch"] and meta["load_avg_before"] is not None


def test_kernels_pass_their_tolerances(dry_run):
    kernels = dry_run[0]["sections"]["kernels"]["result"]
    assert kernels["interpreted"] and kernels["all_pass"]
    names = {c["kernel"].split(" (")[0] for c in kernels["cases"]}
    assert {"decode one-pass", "decode split 2", "prefill", "write_kv", "copy_blocks"} <= names
    assert {c["dtype"] for c in kernels["cases"]} == {"float32", "bfloat16"}


def test_greedy_tokens_equal_on_every_path(dry_run):
    greedy = dry_run[0]["sections"]["greedy"]["result"]
    assert greedy["errors"] == {}
    assert set(greedy["comparisons"]) == {
        "pagedkv triton", "pagedkv triton + cuda graphs", "pagedkv torch sdpa", "transformers"
    }  # fmt: skip
    for name, comparison in greedy["comparisons"].items():
        assert comparison["identical"] == greedy["prompts"], name


def test_ledger_engine_and_simulator_recorded(dry_run):
    sections = dry_run[0]["sections"]
    rows = sections["ledger"]["result"]["rows"]
    assert any("block size 8" in r for row in rows for r in row.get("refused", []))
    assert any(row.get("median_ms", 0) > 0 for row in rows)
    engine = sections["engine"]["result"]
    assert engine["errors"] == {} and engine["pagedkv"]["cuda_graphs"]["graph_replays"] > 0
    assert all(run["generated_tokens"] == engine["output_tokens"]
               for run in engine["pagedkv"].values())  # fmt: skip
    assert engine["transformers"]["useful_tokens"] == engine["output_tokens"]
    sim = sections["profile_sim"]["result"]
    assert sim["predicted_s"] > 0 and Path(sim["profile_path"]).is_file()


def test_summary_has_every_section_header(dry_run):
    _, stdout = dry_run
    for name in SECTIONS:
        assert f"## {name} (" in stdout
