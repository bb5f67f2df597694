"""`pagedkv calibrate --from-gpu-check` (``sim/pagedkv_triton/calibrate.py``, ``pagedkv_triton/check_data.py``,
``pagedkv_triton/check.py``): a device check made by hand from a known clock is fitted back to it and
its engine runs predicted; bad checks are one-line errors; the shared H200 check (when present)
meets the ledger bar."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.errors import UsageError
from pagedkv.pages.triton_splits import decode_splits
from pagedkv.sim.clock_presets import clock_for
from pagedkv.sim.pagedkv_triton.check_data import read_gpu_check
from pagedkv.sim.pagedkv_triton.cost import EngineCostModel
from pagedkv.sim.pagedkv_triton.decode_law import DecodeCall, decode_call_s
from tests.sim.pagedkv_triton.test_clock import GPU, MODEL, TRUE, _synthetic_steps

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data" / "gpu_check_h200"
TRACE_ROWS = [(374, 44), (396, 109), (879, 55), (91, 16), (1500, 30), (20, 200)]


def _true_clock():
    """TRUE with the GEMM law calibrate borrows (the H200's vLLM-class clock)."""
    vllm, _ = clock_for(GPU)
    return replace(TRUE, gemm_launch_s=vllm.gemm_launch_s, gemm_bw_eff=vllm.gemm_bw_eff,
                   gemm_flops_eff=vllm.gemm_flops_eff, gemm_knee=vllm.gemm_knee)  # fmt: skip


def _write_check(tmp: Path, clock) -> tuple[Path, Path]:
    """A device check as the clock section writes it, every time made from ``clock``: the
    ledger's grid, eager and graph steps, and engine runs replayed on it."""
    from pagedkv.sim.pagedkv_triton.check import replay, workload_requests
    from pagedkv.sim.pagedkv_triton.check_data import EngineWorkload

    rows = []
    for context in (1024, 4096, 16384):
        for batch in (1, 8, 32, 128, 256):
            for b in (16, 32, 64, 128):
                splits = decode_splits(batch, 8, context, GPU.num_sms)
                ms = 1e3 * decode_call_s("walk", clock.decode, GPU,
                                         DecodeCall(batch, context, b, splits, 8, 128, 2))  # fmt: skip
                rows.append({"block_size": b, "context_len": context, "batch": batch,
                             "num_splits": splits, "median_ms": ms})  # fmt: skip
    rows.append({"block_size": 8, "context_len": 1024, "batch": 1, "refused": ["too small"]})
    eager, graphs = _synthetic_steps(clock)
    trace = tmp / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{i:02d}.0,{p},{o}\n" for i, (p, o) in enumerate(TRACE_ROWS)))  # fmt: skip
    workload = EngineWorkload("trace.csv", len(TRACE_ROWS), 1024, 128, 4, 512, 1168, 16, 400,
                              "vllm", sum(min(p, 1024) for p, _ in TRACE_ROWS),
                              sum(min(o, 128) for _, o in TRACE_ROWS))  # fmt: skip
    requests = workload_requests(workload, trace)
    runs = {mode: replay(workload, requests, EngineCostModel(MODEL, GPU, clock, mode == "graphs"))
            for mode in ("eager", "graphs")}  # fmt: skip
    check = {
        "meta": {"device_name": "NVIDIA H200"},
        "sections": {
            "ledger": {"ok": True, "result": {"shape": {"num_q_heads": 32, "num_kv_heads": 8,
                       "head_dim": 128, "dtype": "bfloat16"}, "rows": rows}},
            "engine": {"ok": True, "result": {"model": "llama-3-8b", "pagedkv": {
                "eager": {"seconds": runs["eager"].duration_s, "steps": runs["eager"].num_steps,
                          "num_blocks": 400},
                "cuda_graphs": {"seconds": runs["graphs"].duration_s,
                                "steps": runs["graphs"].num_steps, "num_blocks": 400}}}},
            "clock": {"ok": True, "result": {
                "eager_steps": [{**asdict(s.shape), "seconds": s.seconds} for s in eager],
                "graph_steps": [{**asdict(s.shape), "seconds": s.seconds} for s in graphs],
                "workload": asdict(workload)}},
        },
    }  # fmt: skip
    path = tmp / "gpu_check.json"
    path.write_text(json.dumps(check))
    return path, trace


def test_a_check_made_from_a_known_clock_is_fitted_back_and_its_runs_predicted(tmp_path) -> None:
    pytest.importorskip("scipy")
    from pagedkv.sim.pagedkv_triton.calibrate import calibrate_engine

    clock = _true_clock()
    path, trace = _write_check(tmp_path, clock)
    fitted = calibrate_engine(path, trace=trace)
    assert fitted.clock.decode_law == "walk"
    for name, value in clock.decode.items():
        assert fitted.clock.decode[name] == pytest.approx(value, rel=0.02), name
    assert fitted.clock.host_per_seq_s == pytest.approx(clock.host_per_seq_s, rel=0.05)
    assert set(fitted.clock.sources) == {"decode_attention", "gemm", "prefill_attention",
                                         "elementwise", "host", "host_eager",
                                         "host_graphs"}  # fmt: skip
    assert "no host-only step timed" in fitted.clock.sources["host"]
    assert fitted.clock.sources["gemm"].startswith("borrowed: vLLM-class reference clock")
    assert "CUDA-graph steps" in fitted.clock.sources["host_graphs"]
    runs = fitted.meta["runs"]
    for mode in ("eager", "cuda_graphs"):
        assert abs(runs[mode]["rel_err"]) < 0.01, (mode, runs[mode])
        assert runs[mode]["steps"]["engine"] == runs[mode]["steps"]["simulator"]


def test_host_only_steps_fit_the_host_and_the_runs_are_still_predicted(tmp_path) -> None:
    """A check whose clock section timed host-only steps (the forward removed): the four host
    terms are fitted to them (per table entry and per token included), the rest to the steps,
    and the runs (whose steps know their longest context) are predicted within 1 %."""
    pytest.importorskip("scipy")
    from pagedkv.sim.pagedkv_triton.calibrate import calibrate_engine
    from pagedkv.sim.pagedkv_triton.fit import HOST_PARAMS
    from tests.sim.pagedkv_triton.test_clock import _host_steps

    clock = replace(_true_clock(), host_per_table_entry_s=9e-8, host_per_token_s=4e-7)
    path, trace = _write_check(tmp_path, clock)
    data = json.loads(path.read_text())
    data["sections"]["clock"]["result"]["host_steps"] = [
        {**asdict(s.shape), "seconds": s.seconds} for s in _host_steps(clock)
    ]
    path.write_text(json.dumps(data))
    fitted = calibrate_engine(path, trace=trace)
    for name in HOST_PARAMS:
        assert getattr(fitted.clock, name) == pytest.approx(getattr(clock, name), rel=1e-3), name
    assert fitted.clock.sources["host"].startswith("fitted on 20 host-only steps")
    assert fitted.meta["steps"]["host_only"]["all"]["max_rel_err"] < 1e-3
    for mode in ("eager", "cuda_graphs"):
        assert abs(fitted.meta["runs"][mode]["rel_err"]) < 0.01, mode
    # a host-only step must know its longest context
    data["sections"]["clock"]["result"]["host_steps"][0].pop("max_context_tokens")
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="every host-only step needs its max_context_tokens"):
        read_gpu_check(path)


def test_the_command_writes_a_clock_simulate_reads(tmp_path, capsys) -> None:
    pytest.importorskip("scipy")
    path, trace = _write_check(tmp_path, _true_clock())
    out = tmp_path / "clock.json"
    argv = ["calibrate", "--from-gpu-check", str(path), "--trace", str(trace), "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "walk (chosen)" in printed and "cuda_graphs" in printed and f"wrote {out}" in printed
    argv = ["simulate", "--synthetic", "requests=20,prompt=100-300,output=20-40", "--gpu",
            "H200-141GB", "--policy", "vllm", "--clock", str(out), "--json"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)[0]["num_finished"] == 20


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(sections={}), "not a device check|no ledger section"),
        (lambda d: d["sections"].pop("ledger"), "no ledger section that ran"),
        (lambda d: d["meta"].update(device_name="cpu"), "no GPU preset; name one with --gpu"),
        (
            lambda d: d["sections"]["ledger"]["result"]["rows"][0].update(median_ms=-1.0),
            "sizes and time must be > 0",
        ),
        (
            lambda d: d["sections"]["clock"]["result"].update(
                eager_steps=[{"seconds": 1.0, "bogus": 1}]
            ),
            "a step is StepShape's fields",
        ),
        (lambda d: d["sections"]["clock"]["result"].update(eager_steps=[]), "no timed eager steps"),
    ],
)
def test_a_bad_check_is_one_line_exit_2(tmp_path, capsys, edit, match) -> None:
    path, _ = _write_check(tmp_path, _true_clock())
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    assert main(["calibrate", "--from-gpu-check", str(path), "-o", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "error:" in err
    with pytest.raises(UsageError, match=match):
        read_gpu_check(path)


def test_a_ledger_of_the_tile_kernels_keeps_its_layouts_apart(tmp_path) -> None:
    """Checks from the tile kernels on (cf28990) time each point paged and contiguous: a
    contiguous row (block_size = context_len) is no paged row of B = context; the fit reads
    the paged rows, the contiguous ones are kept apart; a row without a layout is paged (the
    first H200 check's); an unknown layout is refused. The section's prefill list and
    paged_over_contiguous are not read."""
    path, _ = _write_check(tmp_path, _true_clock())
    data = json.loads(path.read_text())
    ledger = data["sections"]["ledger"]["result"]
    rows = ledger["rows"]
    paged_before = len([r for r in rows if "median_ms" in r])
    rows[0]["layout"] = "paged"
    rows += [
        {"block_size": 1024, "context_len": 1024, "batch": 32, "layout": "contiguous",
         "variant": "rule", "num_splits": 1, "median_ms": 0.04},
        {"block_size": 4096, "context_len": 4096, "batch": 1, "layout": "contiguous",
         "variant": "one pass", "num_splits": 1, "median_ms": 0.05},
    ]  # fmt: skip
    ledger.update(tile_tokens=64, prefill=[{"context_len": 2048, "pagedkv": {"tflop_s": 300.0}}],
                  paged_over_contiguous=[{"block_size": 16, "context_len": 1024, "batch": 32,
                                          "ratio": 1.1}])  # fmt: skip
    path.write_text(json.dumps(data))
    got = read_gpu_check(path)
    assert len(got.ledger) == paged_before
    assert all(r.call.block_size < r.call.context_tokens for r in got.ledger)
    assert [(r.call.block_size, r.call.batch, r.seconds) for r in got.contiguous] == [
        (1024, 32, pytest.approx(4e-5)),
        (4096, 1, pytest.approx(5e-5)),
    ]
    rows[1]["layout"] = "tiled"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=r"rows\[1\]\.layout must be one of paged, contiguous"):
        read_gpu_check(path)
    ledger["rows"] = [dict(r, layout="contiguous") for r in rows]
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="timed no paged row"):
        read_gpu_check(path)


def test_a_step_that_recorded_its_longest_context_reads_as_one(tmp_path) -> None:
    """The clock section records each step's longest context (and, for people, its compiles):
    such a step is a LongestShape; one without stays a StepShape."""
    from pagedkv.sim.pagedkv_triton.step_context import LongestShape, longest_context_tokens

    path, _ = _write_check(tmp_path, _true_clock())
    data = json.loads(path.read_text())
    steps = data["sections"]["clock"]["result"]["eager_steps"]
    steps[0].update(max_context_tokens=2048, compiles=1, compile_s=0.8)
    path.write_text(json.dumps(data))
    got = read_gpu_check(path).eager_steps
    assert isinstance(got[0].shape, LongestShape) and longest_context_tokens(got[0].shape) == 2048
    assert not isinstance(got[1].shape, LongestShape)


def test_a_workload_that_is_not_the_checks_is_refused(tmp_path) -> None:
    from pagedkv.sim.pagedkv_triton.check import workload_requests

    path, trace = _write_check(tmp_path, _true_clock())
    workload = read_gpu_check(path).workload
    assert workload is not None
    with pytest.raises(UsageError, match="not the workload it measured"):
        workload_requests(replace(workload, prompt_tokens=workload.prompt_tokens + 1), trace)


def test_flags_are_checked(tmp_path, capsys) -> None:
    out = str(tmp_path / "o.json")
    assert main(["calibrate", "--data", str(tmp_path), "-o", out]) == 2
    assert "--data needs --gpu" in capsys.readouterr().err
    assert main(["calibrate", "--from-gpu-check", str(tmp_path / "none.json"), "-o", out]) == 2
    assert "cannot read device check" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one source only
        main(["calibrate", "--data", "x", "--from-gpu-check", "y", "-o", out])


@pytest.mark.skipif(not (SHARED / "gpu_check.json").is_file(), reason="no shared H200 check")
def test_the_shared_h200_check_meets_the_ledger_bar() -> None:
    """Issue 47's ledger bar on the measured data: the chosen law's leave-one-context-out
    median error <= 10 %; the steps it was fitted to reproduced within 5 % (median)."""
    pytest.importorskip("scipy")
    from pagedkv.sim.pagedkv_triton.calibrate import calibrate_engine

    fitted = calibrate_engine(SHARED / "gpu_check.json", trace=Path("/nonexistent.csv"))
    chosen = next(s for s in fitted.meta["decode_laws"] if s["law"] == fitted.clock.decode_law)
    assert chosen["loco_median_err"] <= 0.10
    for kind in ("prefill", "mixed", "decode"):
        assert fitted.meta["steps"]["eager"][kind]["median_rel_err"] < 0.05
    assert "skipped" in fitted.meta["runs"]  # no trace given: said, not crashed
