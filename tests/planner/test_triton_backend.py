"""The planner's ``triton`` backend is the Triton kernels' own rule (``pages/triton_rules.py``):
the tile is not the page, so every block size runs and only the head dim is constrained,
checked here against hand-derived values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.errors import UsageError
from pagedkv.pages import triton_rules
from pagedkv.pages.layout import mha_layout
from pagedkv.planner.constraints import BACKENDS, constraint_violations, resolve_block_size

LLAMA = mha_layout(32, 8, 128, "bf16")


@pytest.mark.parametrize("block_size", [1, 2, 3, 8, 12, 16, 48, 256, 512, 2048, 131072])
def test_every_block_size_is_accepted(block_size):
    """SGLang's 1, non-powers of two, and a whole max_model_len region (the reserved policy)."""
    assert constraint_violations(block_size, BACKENDS["triton"], LLAMA) == []
    assert resolve_block_size(block_size, "triton", LLAMA).rewrites == []
    assert triton_rules.block_size_problems(block_size, 128) == []


def test_the_backend_says_why_it_takes_every_size():
    assert BACKENDS["triton"].allowed_block_sizes == ()  # any >= 1
    assert "tile is not the page" in BACKENDS["triton"].note
    assert triton_rules.block_size_problems(0) == [
        "block size 0 is not a positive size in triton paged decode, paged prefill, KV write, "
        "block copy"
    ]


def test_the_kv_write_and_block_copy_take_any_block_size():
    for size in (1, 12, 48, 1000):
        assert triton_rules.KV_WRITE.problems(size, 128) == []
        assert triton_rules.BLOCK_COPY.problems(size, 80) == []
    assert triton_rules.KV_WRITE.problems(16, 80) == [
        "head dim 80 is not a power of two (tl.arange needs one)"
    ]


def test_a_head_dim_the_kernels_refuse_is_an_error_no_block_size_cures():
    with pytest.raises(UsageError, match="head dim 80 is not a power of two"):
        resolve_block_size(16, "triton", mha_layout(32, 8, 80, "bf16"))
    with pytest.raises(UsageError, match="head dim 8 is under 16"):
        resolve_block_size(16, "triton", mha_layout(2, 2, 8, "fp32"))


def test_plan_backend_triton_excludes_no_size_and_says_why():
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv", "plan", "--model", "llama-3-8b", "--num-seqs", "64",
         "--mean-len", "600", "--backend", "triton", "--block-sizes", "1,8,12,16,32,512"],
        capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # rich wraps long lines
    assert "excluded by hard constraints" not in out
    assert "tiles of T tokens are gathered through the block table" in out
