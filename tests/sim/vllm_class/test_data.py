"""Measured op files read as the Vidur layout says (sim/vllm_class/data.py), the error report over
them (benchmarks/clock_vs_measured.py) and `pagedkv calibrate` on hand-made files."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.errors import UsageError
from pagedkv.sim.gpus import get_gpu
from pagedkv.sim.vllm_class.clock import ELEMENTWISE_OPS, GPUClock
from pagedkv.sim.vllm_class.data import GEMM_OPS, OpRow, price, read_rows
from pagedkv.sim.vllm_class.fit import write_clock

_SPEC = importlib.util.spec_from_file_location(
    "clock_vs_measured", Path(__file__).parents[3] / "benchmarks" / "clock_vs_measured.py"
)
assert _SPEC is not None and _SPEC.loader is not None
report = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(report)

A100 = get_gpu("a100")


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _mlp(tokens: int, ms: float) -> dict:
    times = {f"time_stats.{op}.median": ms for op in (*GEMM_OPS, *ELEMENTWISE_OPS)}
    shape = {"n_head": 8, "n_kv_head": 2, "n_embd": 512, "n_expanded_embd": 1024,
             "vocab_size": 1000, "use_gated_mlp": "True"}  # fmt: skip
    return {**times, **shape, "num_tokens": tokens, "num_tensor_parallel_workers": 2}


def _attention(decode: bool, size: int, context: int, ms: float) -> dict:
    return {
        "time_stats.attn_decode.median": ms if decode else "",
        "time_stats.attn_prefill.median": "" if decode else ms,
        "n_embd": 1024, "n_q_head": 16, "n_kv_head": 4, "block_size": 16,
        "num_tensor_parallel_workers": 2, "batch_size": size if decode else 1,
        "prefill_chunk_size": 0 if decode else size, "kv_cache_size": context,
        "is_prefill": str(not decode),
    }  # fmt: skip


def _overhead(batch: int, ms: float) -> dict:
    parts = {f"{p}_median": ms for p in ("schedule", "sampler_e2e", "prepare_inputs_e2e",
                                          "process_model_outputs")}  # fmt: skip
    return {**parts, "model_name": "org/m", "batch_size": batch, "tensor_parallel_degree": 2}


def _dataset(root: Path) -> Path:
    _write(root / "compute/a100/org/m/mlp.csv", [_mlp(1, 0.010), _mlp(2, 0.008)])
    _write(root / "a100/attention.csv", [_attention(True, 4, 100, 0.02),
                                         _attention(False, 64, 32, 0.03)])  # fmt: skip
    _write(root / "a100/cpu_overheads.csv", [_overhead(8, 0.25), _overhead(16, 0.3)])
    _write(root / "compute/a100/org/m/attention.csv", [_attention(True, 2, 50, 0.01)])
    (root / "a100/notes.txt").write_text("ignored")
    return root


def test_rows_carry_the_per_gpu_shapes_and_seconds(tmp_path) -> None:
    rows = read_rows(_dataset(tmp_path / "profiles"))
    gemm = {r.op: r.dims for r in rows if r.family == "gemm" and r.dims[0] == 1}
    # hidden 512, 8 heads of 64, 2 KV heads, MLP 1024 (gated), TP 2: each GPU's part
    assert gemm == {
        "attn_pre_proj": (1, 512, (8 + 2 * 2) * 64 // 2),
        "attn_post_proj": (1, 8 * 64 // 2, 512),
        "mlp_up_proj": (1, 512, 2 * 1024 // 2),
        "mlp_down_proj": (1, 1024 // 2, 512),
    }
    # bytes moved: the add reads two and writes one hidden vector of fp16 per token; the
    # gated activation reads 2 x 512 and writes 512 (this GPU's half of 1024) per token
    adds = sorted(r.dims[0] for r in rows if r.op == "add")
    assert adds == [3 * 2 * 1 * 512, 3 * 2 * 2 * 512]
    acts = sorted(r.dims[0] for r in rows if r.op == "mlp_act")
    assert acts == [3 * 2 * 1 * 512, 3 * 2 * 2 * 512]
    decodes = sorted((r.dims, r.measured_s) for r in rows if r.family == "decode_attention")
    assert decodes[0][0] == (2, 51, 2, 64)  # compute/<gpu>/<org>/<model>/attention.csv
    assert decodes[1][0] == (4, 101, 2, 64) and decodes[1][1] == pytest.approx(2e-5)
    prefill = next(r for r in rows if r.family == "prefill_attention")
    assert prefill.dims == (64, 32, 8, 64)
    cpu = sorted((r.dims, r.measured_s) for r in rows if r.family == "step_overhead")
    assert cpu[0][0] == (8, 2) and cpu[0][1] == pytest.approx(4 * 0.25e-3)
    assert all(r.file.startswith("profiles/") for r in rows)  # no machine's path in reports


def test_a_folder_without_profiles_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(UsageError, match="not a folder"):
        read_rows(tmp_path / "nope")
    with pytest.raises(UsageError, match="no profile files"):
        read_rows(tmp_path)


def test_the_report_gives_each_group_its_errors(tmp_path) -> None:
    data = _dataset(tmp_path / "profiles")
    clock = GPUClock()
    # rewrite every measured time as exactly twice the clock's price: every error is -50 %
    rows = read_rows(data)
    doubled = [OpRow(r.family, r.op, r.gpu, r.model, r.tp, r.dims, 2 * price(r, clock, A100),
                     r.file) for r in rows]  # fmt: skip
    clock_file = tmp_path / "clock.json"
    write_clock(clock_file, clock, A100, {})
    records = report.report(doubled, str(clock_file), baseline=True)
    assert {(r["family"], r["model"]) for r in records} >= {("gemm", "org/m"), ("gemm", "all")}
    for r in records:
        assert r["median_rel_err"] == pytest.approx(0.5) and r["max_rel_err"] == pytest.approx(0.5)
        assert "baseline" in r
    out = tmp_path / "r.json"
    assert report.main(["--data", str(data), "--clock", str(clock_file), "--json", str(out)]) == 0
    saved = json.loads(out.read_text())["records"]
    keys = {"family", "gpu", "model", "rows", "median_rel_err", "max_rel_err"}
    assert all(keys <= set(r) for r in saved)


def test_the_monotone_floor_by_hand() -> None:
    def row(m: int, seconds: float) -> OpRow:
        return OpRow("gemm", "mlp_up_proj", "a100", "m", 1, (m, 8, 8), seconds, "f")

    # more work measured faster: 10 then 8 -> no monotone clock beats (10-8)/(10+8)
    assert report.monotone_floor([row(1, 10.0), row(2, 8.0)]) == pytest.approx(2 / 18)
    assert report.monotone_floor([row(1, 8.0), row(2, 10.0)]) == 0.0
    # the same work measured twice differently: (12-8)/(12+8)
    assert report.monotone_floor([row(4, 8.0), row(4, 12.0)]) == pytest.approx(0.2)


def test_calibrate_writes_a_clock_and_refuses_bad_input(tmp_path, capsys) -> None:
    pytest.importorskip("scipy")
    data = _dataset(tmp_path / "profiles")
    out = tmp_path / "clock.json"
    assert main(["calibrate", "--data", str(data), "--gpu", "a100", "-o", str(out)]) == 0
    meta = json.loads(out.read_text())
    assert meta["gpu"] == "A100-80GB" and set(meta["families"]) == {
        "gemm", "elementwise", "decode_attention", "prefill_attention", "step_overhead"
    }  # fmt: skip
    assert "fitting gemm" in capsys.readouterr().err
    for argv, words in (
        (["--data", str(tmp_path / "none"), "--gpu", "a100"], "not a folder"),
        (["--data", str(data), "--gpu", "v100"], "unknown GPU 'v100'"),
        (["--data", str(data), "--gpu", "h100"], "no rows of that GPU folder"),
    ):
        assert main(["calibrate", *argv, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
