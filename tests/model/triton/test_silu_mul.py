"""The fused SiLU * mul against ``layers.SwiGLU``'s own activation (``gated``: the gate is the
first half of the fused gate/up product), under the Triton interpreter on tiny shapes.

Equality: the arithmetic is torch's op for op (``g / (1 + exp(-g))`` rounded to the dtype, then
``* up`` rounded) except ``exp`` itself (torch's CPU SLEEF vs numpy's in the interpreter, each
within about an ulp): fp32 outputs within ``FP32_ULPS`` of torch's (measured: <= 4), bf16 ones
at most ``BF16_ULPS`` (one rounding boundary crossed by silu, carried through the product) with
at least ``BF16_EQUAL`` of the elements bit-equal (measured: all).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedkv.model.layers import SwiGLU
from pagedkv.model.projection import column_halves
from pagedkv.model.triton.silu_mul import silu_mul

from .fused_support import round_bf16_to_nearest_even, ulps

FP32_ULPS = 8
BF16_ULPS = 2
BF16_EQUAL = 0.99
# exp(100) overflows to inf in the interpreter's numpy (silu(-100) is then -0, as in torch)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture(autouse=True)
def _bf16_rounds_to_nearest_even(monkeypatch):
    round_bf16_to_nearest_even(monkeypatch)


class _Product(nn.Module):
    """Stands in for the gate/up projection: its "product" is the tensor it is given."""

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return column_halves(x)


def torch_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``layers.SwiGLU.gated`` on ``gate_up`` as if it were the gate/up projection's output."""
    mlp = SwiGLU(1, gate_up.shape[1] // 2)
    mlp.gate_up_proj = _Product()
    return mlp.gated(gate_up)


def make_gate_up(num_tokens, inter, dtype, seed):
    """[T, 2I], values ~N(0, 4^2) and, in the first row, the extremes: 0, +-30, +-100 (exp
    overflows at -g > 88: silu is then -0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 2 * inter, generator=gen) * 4
    x[0, :5] = torch.tensor([0.0, 30.0, -30.0, 100.0, -100.0])
    return x.to(dtype)


@pytest.mark.parametrize(
    ("dtype", "num_tokens", "inter"),
    [  # 1,100 columns: two programs a row, the second masked
        (torch.float32, 1, 64),
        (torch.float32, 3, 96),
        (torch.float32, 5, 1100),
        (torch.bfloat16, 1, 64),
        (torch.bfloat16, 3, 96),
        (torch.bfloat16, 5, 1100),
    ],
)
def test_silu_mul_matches_swiglu(dtype, num_tokens, inter):
    gate_up = make_gate_up(num_tokens, inter, dtype, seed=inter)
    want = torch_reference(gate_up)

    got = silu_mul(gate_up)

    assert got.dtype == dtype and got.shape == (num_tokens, inter)
    distance = ulps(got, want)
    if dtype == torch.float32:
        assert distance.max().item() <= FP32_ULPS
    else:
        assert distance.max().item() <= BF16_ULPS
        assert (distance == 0).float().mean().item() >= BF16_EQUAL
    assert torch.equal(got[0, :5], want[0, :5])  # 0, +-30, +-100: exact either way


def test_strided_rows_into_a_given_out():
    """Rows of a wider tensor in, rows of a wider buffer out; nothing else of it written."""
    gate_up = make_gate_up(3, 64, torch.float32, seed=7)
    wide_in = torch.randn(3, 200)
    wide_in[:, 8:136] = gate_up
    wide_out = torch.full((3, 80), 7.0)

    got = silu_mul(wide_in[:, 8:136], out=wide_out[:, 16:])

    assert got.data_ptr() == wide_out[:, 16:].data_ptr()
    assert ulps(wide_out[:, 16:], torch_reference(gate_up)).max().item() <= FP32_ULPS
    assert torch.equal(wide_out[:, :16], torch.full((3, 16), 7.0))


def test_no_tokens_and_refusals():
    assert silu_mul(torch.zeros(0, 128)).shape == (0, 64)
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.zeros(2, 63))
    with pytest.raises(ValueError, match="out"):
        silu_mul(torch.zeros(2, 64), out=torch.zeros(2, 64))
