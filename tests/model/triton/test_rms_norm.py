"""The fused RMSNorm (+ residual add) against ``layers.RMSNorm`` (its torch path) and a torch
add, under the Triton interpreter (conftest.py) on tiny shapes.

Equality: the new residual is bit-equal (one add, the same rounding). The norm's arithmetic is
the same op for op except the order of the sum of squares (torch's vectorised cascade, Triton's
tree), so the mean may differ in its last bit or two; through ``1 / sqrt``, ``x * r`` and
``* weight`` (one rounding each) fp32 outputs stay within ``FP32_ULPS`` (measured: <= 4). In
bf16 those fp32 differences vanish in the rounding to bf16 except at a rounding boundary,
where the normed value moves one bf16 ulp and ``* weight`` rounded again can make it two: at
most ``BF16_ULPS``, and at least ``BF16_EQUAL`` of the elements bit-equal (measured: all).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.layers import RMSNorm
from pagedkv.model.triton.rms_norm import rms_norm

from .fused_support import round_bf16_to_nearest_even, ulps

FP32_ULPS = 8
BF16_ULPS = 2
BF16_EQUAL = 0.99
EPS = 1e-5


@pytest.fixture(autouse=True)
def _bf16_rounds_to_nearest_even(monkeypatch):
    round_bf16_to_nearest_even(monkeypatch)


def make_rows(num_tokens, hidden, dtype, seed):
    """x, residual [T, H] with rows of very different scales (1e-3 .. 1e3), and a torch
    ``RMSNorm`` with a random weight, all in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.linspace(-3, 3, num_tokens)[:, None]
    x = (torch.randn(num_tokens, hidden, generator=gen) * scales).to(dtype)
    residual = (torch.randn(num_tokens, hidden, generator=gen) * scales).to(dtype)
    norm = RMSNorm(hidden, EPS)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    return x, residual, norm


def assert_within_bounds(got, want):
    distance = ulps(got, want)
    if got.dtype == torch.float32:
        assert distance.max().item() <= FP32_ULPS
    else:
        assert distance.max().item() <= BF16_ULPS
        assert (distance == 0).float().mean().item() >= BF16_EQUAL


CASES = [  # (dtype, tokens, hidden): odd token counts, a power-of-two and two masked rows
    (torch.float32, 1, 64),
    (torch.float32, 3, 200),
    (torch.float32, 7, 576),
    (torch.bfloat16, 1, 64),
    (torch.bfloat16, 3, 200),
    (torch.bfloat16, 7, 576),
]


@pytest.mark.parametrize(("dtype", "num_tokens", "hidden"), CASES)
def test_add_rms_norm_matches_the_torch_add_then_norm(dtype, num_tokens, hidden):
    x, residual, norm = make_rows(num_tokens, hidden, dtype, seed=hidden)
    want_residual = x + residual
    want = norm(want_residual)

    out, new_residual = rms_norm(x, norm.weight, EPS, residual)

    assert out.dtype == dtype and new_residual.dtype == dtype
    assert torch.equal(new_residual, want_residual)
    assert_within_bounds(out, want)


@pytest.mark.parametrize(("dtype", "num_tokens", "hidden"), CASES)
def test_rms_norm_matches_layers_rmsnorm(dtype, num_tokens, hidden):
    x, _, norm = make_rows(num_tokens, hidden, dtype, seed=hidden + 1)
    assert_within_bounds(rms_norm(x, norm.weight, EPS), norm(x))


def test_a_zero_row_normalises_to_zero_as_torch_does():
    x = torch.zeros(3, 64)
    x[1] = torch.randn(64, generator=torch.Generator().manual_seed(0))
    norm = RMSNorm(64, EPS)
    out = rms_norm(x, norm.weight, EPS)
    assert torch.equal(out[[0, 2]], torch.zeros(2, 64))
    assert ulps(out, norm(x)).max().item() <= FP32_ULPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_on_strided_rows(dtype):
    """vLLM's contract: ``x`` becomes the output, ``residual`` the new residual; rows of a wider
    tensor (a strided view) are read and written through their stride, the rest untouched."""
    x, residual, norm = make_rows(5, 96, dtype, seed=3)
    wide_x = torch.randn(5, 160).to(dtype)
    wide_x[:, :96] = x
    wide_r = torch.randn(5, 128).to(dtype)
    wide_r[:, 32:] = residual
    before_x, before_r = wide_x.clone(), wide_r.clone()
    view_x, view_r = wide_x[:, :96], wide_r[:, 32:]
    want_residual = x + residual
    want = norm(want_residual)

    out, new_residual = rms_norm(view_x, norm.weight, EPS, view_r, in_place=True)

    assert out.data_ptr() == view_x.data_ptr() and new_residual.data_ptr() == view_r.data_ptr()
    assert torch.equal(view_r, want_residual)
    assert_within_bounds(view_x, want)
    assert torch.equal(wide_x[:, 96:], before_x[:, 96:])
    assert torch.equal(wide_r[:, :32], before_r[:, :32])


def test_no_tokens_launches_nothing():
    x = torch.zeros(0, 64)
    out, new_residual = rms_norm(x, torch.ones(64), EPS, torch.zeros(0, 64))
    assert out.shape == (0, 64) and new_residual.shape == (0, 64)


def test_refuses_mixed_dtypes_and_shapes():
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, torch.ones(64, dtype=torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(64), EPS, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32), EPS)
