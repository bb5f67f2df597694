"""``benchmarks/bench_fused.py --dry-run``: the fused kernels' benchmark on this CPU under
Triton's interpreter at tiny shapes, so the script a GPU machine runs cannot rot. Checks what
it records (every kernel, dtype and token count; every row within the tests' bounds; RoPE + KV
write bit-equal), never how fast anything was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNELS = {"add_rms_norm", "rms_norm", "silu_mul", "rope_kv_write"}


def test_bench_fused_dry_run(tmp_path):
    pytest.importorskip("triton")
    output = tmp_path / "bench_fused.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_fused.py", "--dry-run", "--output", str(output)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(output.read_text())["rows"]
    seen = {(r["kernel"], r["dtype"], r["tokens"]) for r in rows}
    assert seen == {(k, d, t) for k in KERNELS for d in ("float32", "bfloat16") for t in (1, 3)}
    assert all(r["ok"] and r["max_ulps"] <= r["bound_ulps"] for r in rows)
    assert all(r["max_ulps"] == 0 for r in rows if r["kernel"] == "rope_kv_write")
    assert all(r["torch_gpu_us"] > 0 and r["fused_eager_us"] > 0 for r in rows)
    assert "16 rows, 0 out of bounds" in proc.stdout
