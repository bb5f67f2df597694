"""The planner's ``triton`` backend is the Triton kernels' own rule (``pages/triton_rules.py``):
its sizes and its reasons are the kernels', checked here against hand-derived values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.errors import UsageError
from pagedkv.pages import triton_rules
from pagedkv.pages.layout import mha_layout
from pagedkv.planner.constraints import BACKENDS, constraint_violations, resolve_block_size

LLAMA = mha_layout(32, 8, 128, "bf16")


def test_the_allowed_sizes_are_the_powers_of_two_from_16_to_256():
    assert triton_rules.allowed_block_sizes() == (16, 32, 64, 128, 256)
    assert BACKENDS["triton"].allowed_block_sizes == (16, 32, 64, 128, 256)


@pytest.mark.parametrize(
    ("block_size", "why"),
    [
        (1, "block size 1 is under 16 (tl.dot's smallest tile)"),
        (8, "block size 8 is under 16 (tl.dot's smallest tile)"),
        (12, "block size 12 is not a power of two (tl.arange needs one)"),
        (48, "block size 48 is not a power of two (tl.arange needs one)"),
        (512, "block size 512 is over 256 (the tile outgrows a program)"),
    ],
)
def test_a_refused_size_names_the_kernels_reason(block_size, why):
    reasons = constraint_violations(block_size, BACKENDS["triton"], LLAMA)
    assert reasons == [f"{why} in triton paged decode, paged prefill"]


def test_the_kv_write_and_block_copy_take_any_block_size():
    for size in (1, 12, 48, 1000):
        assert triton_rules.KV_WRITE.problems(size, 128) == []
        assert triton_rules.BLOCK_COPY.problems(size, 80) == []
    assert triton_rules.KV_WRITE.problems(16, 80) == [
        "head dim 80 is not a power of two (tl.arange needs one)"
    ]


def test_start_up_rewrites_a_refused_size_with_the_reason():
    resolution = resolve_block_size(12, "triton", LLAMA)
    assert resolution.block_size == 16
    line = resolution.log_line()
    assert "12 -> 16: block size 12 is not a power of two (tl.arange needs one)" in line
    assert resolve_block_size(64, "triton", LLAMA).rewrites == []


def test_a_head_dim_the_kernels_refuse_is_an_error_no_block_size_cures():
    with pytest.raises(UsageError, match="head dim 80 is not a power of two"):
        resolve_block_size(16, "triton", mha_layout(32, 8, 80, "bf16"))
    with pytest.raises(UsageError, match="head dim 8 is under 16"):
        resolve_block_size(16, "triton", mha_layout(2, 2, 8, "fp32"))


def test_plan_backend_triton_lists_the_excluded_sizes_with_their_reasons():
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv", "plan", "--model", "llama-3-8b", "--num-seqs", "64",
         "--mean-len", "600", "--backend", "triton", "--block-sizes", "8,12,16,32,512"],
        capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # rich wraps long lines
    assert "recommended block size: 16" in out
    assert "B=8 (block size 8 is under 16 (tl.dot's smallest tile)" in out
    assert "B=12 (block size 12 is not a power of two (tl.arange needs one)" in out
    assert "B=512 (block size 512 is over 256" in out
