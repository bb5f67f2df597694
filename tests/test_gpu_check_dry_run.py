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
SECTIONS = ("kernels", "greedy", "service", "ledger", "mla", "engine", "profile_sim", "clock")
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
    # the summary is also written beside the JSON (after every section: a cut call keeps it)
    assert output.with_suffix(".md").read_text() + "\n" == proc.stdout
    return json.loads(output.read_text()), proc.stdout


def test_sections_that_would_end_past_the_deadline_are_skipped(tmp_path):
    pytest.importorskip("triton")
    output = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--output", str(output),
         "--deadline-s", "0", "--sections", "kernels,ledger"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    sections = json.loads(output.read_text())["sections"]
    assert list(sections) == ["kernels", "ledger"]
    for entry in sections.values():
        assert not entry["ok"] and entry["error"].startswith("skipped: its likely 0 s")
    assert "skipped" in output.with_suffix(".md").read_text()


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
    assert {"decode one-pass", "decode split 2", "prefill", "mixed step", "write_kv",
            "copy_blocks"} <= names  # fmt: skip
    assert {c["block_size"] for c in kernels["cases"]} == {1, 16}
    assert {c["dtype"] for c in kernels["cases"]} == {"float32", "bfloat16"}
    fused = kernels["fused"]  # every fused kernel, both dtypes, within the tests' ulp bounds
    assert {(f["kernel"], f["dtype"]) for f in fused} == {
        (k, d) for k in ("rms_norm", "add_rms_norm", "silu_mul", "rope_kv_write")
        for d in ("float32", "bfloat16")}  # fmt: skip
    assert all(f["ok"] for f in fused)


def test_greedy_tokens_equal_on_every_path(dry_run):
    greedy = dry_run[0]["sections"]["greedy"]["result"]
    assert greedy["errors"] == {}
    assert set(greedy["comparisons"]) == {
        "pagedkv triton", "pagedkv triton + cuda graphs + async", "pagedkv torch sdpa",
        "transformers",
    }  # fmt: skip
    for name, comparison in greedy["comparisons"].items():
        assert comparison["identical"] == greedy["prompts"], name


def test_ledger_engine_and_simulator_recorded(dry_run):
    sections = dry_run[0]["sections"]
    ledger = sections["ledger"]["result"]
    rows = ledger["rows"]
    assert not any("refused" in row for row in rows)  # the tile is not the page: every B runs
    timed = {(row["layout"], row["block_size"]) for row in rows if row.get("median_ms", 0) > 0}
    assert timed == {("paged", 1), ("paged", 3), ("paged", 16), ("contiguous", 40)}
    assert {x["block_size"] for x in ledger["paged_over_contiguous"]} == {1, 3, 16}
    assert all(p["pagedkv"]["tflop_s"] > 0 and p["torch_sdpa"]["tflop_s"] > 0
               for p in ledger["prefill"]) and ledger["prefill"]  # fmt: skip
    engine = sections["engine"]["result"]
    assert engine["errors"] == {} and engine["pagedkv"]["cuda_graphs"]["graph_replays"] > 0
    assert all(run["generated_tokens"] == engine["output_tokens"]
               for run in engine["pagedkv"].values())  # fmt: skip
    assert engine["transformers"]["useful_tokens"] == engine["output_tokens"]
    runs = engine["pagedkv"]
    assert [runs[k]["async_scheduling"] for k in ("eager", "cuda_graphs", "cuda_graphs_async")] == [
        False,
        False,
        True,
    ]
    assert engine["async_same_tokens"] == 1.0  # one step ahead changes no token
    for run in runs.values():  # every timed step in the timeline, each kind's phases present
        kinds = run["timeline"]
        assert sum(v["steps"] for k, v in kinds.items() if k != "idle") == run["steps"]
    b1 = engine["batch1"]
    assert b1["generated_tokens"] == b1["decode_steps"] + 1 and b1["graph_replays"] > 0
    assert b1["memory_limit_ms"] > 0 and b1["weight_bytes"] > 0
    assert set(engine["prompt_gemms"]["projections"]) == {"qkv", "o", "gate_up", "down"}
    sim = sections["profile_sim"]["result"]
    assert sim["predicted_s"] > 0 and Path(sim["profile_path"]).is_file()


def test_the_mla_section_checks_and_times_its_kernel(dry_run):
    """Issue 55's section: the MLA decode kernel within tolerance at every block size, a
    reserved region and split-K, both dtypes; every point timed and held against the copy."""
    mla = dry_run[0]["sections"]["mla"]["result"]
    assert mla["interpreted"] and mla["all_pass"]
    assert {(c["dtype"], c["block_size"], c["num_splits"]) for c in mla["cases"]} == {
        (d, b, s) for d in ("float32", "bfloat16") for b in (1, 16, 21) for s in (1, 3)}  # fmt: skip
    assert {r["block_size"] for r in mla["rows"] if r.get("median_ms", 0) > 0} == {1, 16}
    assert all(r["of_copy_bw"] > 0 for r in mla["rows"]) and mla["summary"]
    assert mla["summary"][0]["shares"].keys() == {"1", "16"}  # B, as JSON keys


def test_summary_has_every_section_header(dry_run):
    _, stdout = dry_run
    for name in SECTIONS:
        assert f"## {name} (" in stdout


def test_the_service_answers_every_case(dry_run):
    """``serve`` as real processes over HTTP (on the CPU here, CUDA on the device): every case
    answered, the P/D pair's text equal to the single server's, the refusal, the tier counters,
    no blocks in use after."""
    service = dry_run[0]["sections"]["service"]["result"]
    assert service["errors"] == {}, service["errors"]  # redis-server is there (make redis)
    cases = service["cases"]
    assert set(cases) == {"chat", "stream", "n4", "cached", "logprobs_echo", "json_schema",
                          "cache_salt", "info_and_metrics", "pd_request", "pd_refused",
                          "pd_relayout", "host_tier", "swap", "route", "no_blocks_in_use"}  # fmt: skip
    assert all(c["ok"] for c in cases.values()), {k: c for k, c in cases.items() if not c["ok"]}
    assert cases["cached"]["cached_tokens"][1] > 0 and cases["swap"]["swap_out_sequences"] > 0
    assert cases["pd_request"]["text"] == cases["chat"]["text"]
    assert "block_size 32 (decode) vs 16 (prefill)" in cases["pd_refused"]["line"]
    assert service["all_ok"]


def test_the_engine_section_records_the_default_pool(dry_run):
    pool = dry_run[0]["sections"]["engine"]["result"]["default_pool"]
    # The CPU's default (a GPU sizes it from the card): 512 MiB less what no block fills.
    assert 0 <= (512 << 20) - pool["kv_cache_bytes"] < pool["kv_cache_bytes"] / pool["num_blocks"]


def test_the_clock_section_fits_and_replays_its_own_runs(dry_run):
    """The last section's path (issue 47): graph and warm-run steps measured, the clock fitted
    from the check's own sections (every decode law scored, every part's source named),
    written beside the JSON in a form ``pagedkv simulate --clock`` reads, and the engine
    section's and the warm runs replayed on it with the engine's step counts."""
    from pagedkv.sim.pagedkv_triton.clock import PARTS, read_engine_clock

    clock = dry_run[0]["sections"]["clock"]["result"]
    assert clock["graph_steps"] and clock["eager_steps"]
    assert {law["law"] for law in clock["decode_laws"]} == {"walk", "overhead", "bandwidth"}
    read, _ = read_engine_clock(clock["clock_path"])
    assert read.gpu == clock["gpu"] and set(read.sources) == set(PARTS)
    engine = dry_run[0]["sections"]["engine"]["result"]["pagedkv"]
    for runs in (clock["runs"], clock["warm_check"]):
        assert set(runs) == {"eager", "cuda_graphs"}
        for mode, check in runs.items():
            assert check["predicted_s"] > 0 and check["steps"]["simulator"] == engine[mode]["steps"]
    for mode, warm in clock["warm_runs"].items():
        assert warm["num_steps"] == len(warm["steps"]) == engine[mode]["steps"]
        assert all(s["max_context_tokens"] >= 1 for s in warm["steps"])
    # the host alone: two replays of the workload with the forward removed, each step with its
    # longest context; the clock's host terms fitted to them (and said so)
    host = clock["host_steps"]
    assert len(host) >= 2 * engine["eager"]["steps"] - 2
    assert all(h["max_context_tokens"] >= 1 and h["seconds"] > 0 for h in host)
    assert read.sources["host"].startswith(f"fitted on {len(host)} host-only steps")
    assert clock["steps"]["host_only"]["all"]["steps"] == len(host)
    # Triton compiles: the hooks ran (nothing compiles under the interpreter)
    assert set(clock["compiles"]) == {"hooks_installed", "by_phase", "events"}


def test_the_compile_log_names_who_compiled(monkeypatch):
    """The clock section's ``CompileLog`` (Triton's compile hooks; under the interpreter
    nothing compiles, so here the hooks are called by hand): each compile is timed and labelled
    by the check's function on the stack, the engine section's warm-up apart from its timed
    run (its local ``t0``), eager apart from graphs."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from gpu_check_clock import CompileLog

    log = CompileLog()
    starting, done = log.hook_pair()

    class Fn:
        name = "_prefill_kernel"

    def compile_once() -> None:
        assert not starting(fn=Fn())  # a true value would make Triton skip the compile
        done(fn=Fn())

    def pagedkv_throughput(graphs):  # the engine section's frame, as gpu_check_engine names it
        compile_once()  # the warm-up
        t0 = 0.0  # noqa: F841 (the timed run's clock, read from the frame)
        compile_once()

    def check_ledger():
        compile_once()

    pagedkv_throughput(False)
    pagedkv_throughput(True)
    check_ledger()
    compile_once()
    assert [e["during"] for e in log.events] == [
        "engine section eager warm-up", "engine section eager timed run",
        "engine section cuda_graphs warm-up", "engine section cuda_graphs timed run",
        "ledger section", "elsewhere"]  # fmt: skip
    summary = log.summary(0.0)
    assert summary["by_phase"]["ledger section"]["compiles"] == 1
    assert all(e["kernel"] == "_prefill_kernel" and e["seconds"] >= 0 for e in summary["events"])
