"""``pk_gemm`` (``native_gemm.c``), the product of more than ``native.MAX_ROWS`` rows: each
output element one chain of fused multiply-adds in k order (checked against exact rational
arithmetic), exact on small integers, the same bits on AVX2 and AVX-512, at any thread count
and in any batch; and the projections above 64 rows taking it, or MKL where switched off."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from pagedkv.model import native
from pagedkv.model.native.projection import NativeProjection, dense_path, gemm_product
from pagedkv.model.native.quant import NativeQuantProjection

LIB = native.kernels()
pytestmark = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gemm(x, w, bias=None, residual=None) -> torch.Tensor:
    y = gemm_product(x, w, bias, residual)
    assert y is not None
    return y


def _fma32(a: float, b: float, c: float) -> float:
    """fp32 fma: a * b + c exactly, rounded once to fp32. The exact value goes through
    float64 (one rounding to 53 bits) first; a second rounding differs from one only on a
    float32 tie, which these random operands do not produce."""
    return float(np.float32(float(Fraction(a) * Fraction(b) + Fraction(c))))


@pytest.mark.parametrize("rows", [3, 70])  # native_chain.c (pk_linear), native_gemm.c
def test_each_element_is_one_fma_chain_in_k_order(rows, isa):
    """The contract that makes the bits independent of tiles, ISA and batch: acc = fma(x[k],
    w[k], acc) from 0, then + bias, then residual +. A sum of lane partials or MKL's blocking
    would differ in some last bits of these elements."""
    k, n = 40, 20  # tiles of 6 or 8 columns, groups of 8 or 16, scalar columns; k % 16 == 8
    x = torch.randn(rows, k, generator=_gen(1))
    w = torch.randn(n, k, generator=_gen(2))
    bias = torch.randn(n, generator=_gen(3))
    residual = torch.randn(rows, n, generator=_gen(4))
    if rows > native.MAX_ROWS:
        got = _gemm(x, w, bias, residual)
    else:
        got = NativeProjection(w, bias).added_to(residual, x)
    xs, ws, bs, rs = x.tolist(), w.tolist(), bias.tolist(), residual.tolist()
    for r in range(rows):
        for c in range(n):
            acc = 0.0
            for i in range(k):
                acc = _fma32(xs[r][i], ws[c][i], acc)
            acc = float(np.float32(acc) + np.float32(bs[c]))
            want = float(np.float32(rs[r][c]) + np.float32(acc))
            assert got[r, c].item() == want, (r, c)


@pytest.mark.parametrize("rows", [65, 97, 130])  # 16-row groups with a tail, panels of 1-4
@pytest.mark.parametrize("k, n", [(8, 4), (40, 13), (576, 96)])  # 4 and 13: scalar columns
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_small_integers_are_exact(threads, rows, k, n, num_threads, isa):
    """Products and sums of small integers are exact in fp32, so any order gives the float64
    reference exactly: the whole product, bias and residual, every element and no other."""
    threads(num_threads)
    x = torch.randint(-8, 9, (rows, k), generator=_gen(rows)).float()
    w = torch.randint(-8, 9, (n, k), generator=_gen(k)).float()
    bias = torch.randint(-8, 9, (n,), generator=_gen(5)).float()
    residual = torch.randint(-8, 9, (rows, n), generator=_gen(6)).float()
    want = x.double() @ w.double().t() + bias.double()
    assert torch.equal(_gemm(x, w, bias).double(), want)
    assert torch.equal(_gemm(x, w, bias, residual).double(), residual.double() + want)
    assert torch.equal(_gemm(x, w).double(), x.double() @ w.double().t())


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_a_row_has_the_same_bits_in_any_batch_at_any_thread_count(threads, num_threads, isa):
    k, n = 200, 30
    x = torch.randn(300, k, generator=_gen(7))
    w = torch.randn(n, k, generator=_gen(8))
    threads(2)
    whole = _gemm(x, w)
    assert torch.allclose(whole.double(), x.double() @ w.double().t(), atol=1e-5 * math.sqrt(k))
    threads(num_threads)
    for start, rows in ((0, 65), (3, 70), (150, 150), (231, 69)):
        part = _gemm(x[start : start + rows].contiguous(), w)
        assert torch.equal(part, whole[start : start + rows]), (start, rows)


@pytest.mark.skipif(not AVX512, reason="needs an AVX-512 CPU")
def test_avx2_and_avx512_give_the_same_bits():
    """The chain per element is the same instructions' arithmetic in both forms."""
    x = torch.randn(150, 576, generator=_gen(9))
    w = torch.randn(66, 576, generator=_gen(10))
    bias = torch.randn(66, generator=_gen(11))
    native.set_isa("avx2")
    narrow = _gemm(x, w, bias)
    native.set_isa("avx512")
    assert torch.equal(_gemm(x, w, bias), narrow)


def test_the_projections_take_it_above_64_rows_and_mkl_when_switched_off():
    gen = _gen(12)
    weight = torch.randn(96, 64, generator=gen)
    module = NativeProjection(weight, torch.randn(96, generator=gen))
    x = torch.randn(80, 64, generator=gen)
    residual = torch.randn(80, 96, generator=gen)
    direct = _gemm(x, module.weight, module.bias)
    assert torch.equal(module(x), direct)
    assert torch.equal(module.added_to(residual, x), _gemm(x, module.weight, module.bias, residual))
    first, second = module.halves(x)
    assert torch.equal(torch.cat([first, second], 1), direct)
    assert "pagedkv's GEMM" in module.describe()
    try:
        native.set_gemm(False)
        assert gemm_product(x, module.weight, module.bias) is None
        assert "MKL" in dense_path()
        mkl = module(x)
        assert torch.allclose(mkl, direct, atol=1e-4)
    finally:
        native.set_gemm(True)


def test_quantized_prompts_multiply_the_dequantized_weight_the_same_way():
    """Above 64 rows a Q4_1 projection takes the same product on its blocks (decoded tile by
    tile): on weights that are exactly block values, the fp32 projection's bits (what keeps
    int4 = fp32 on prompts); with the GEMM off, MKL's on the matrix dequantized whole."""
    gen = _gen(13)
    module = NativeQuantProjection("q4_1", torch.randn(48, 64, generator=gen), None)
    exact = module.dense_weight()
    x = torch.randn(100, 64, generator=gen)
    assert torch.equal(module(x), NativeProjection(exact, None)(x))
    assert "decoding the blocks" in module.describe()
    try:
        native.set_gemm(False)
        assert torch.equal(module(x), x @ exact.t())
        assert "dequantized, then MKL" in module.describe()
    finally:
        native.set_gemm(True)


@pytest.mark.parametrize("span_kb", ["1", "19", "100000"])  # a panel a span, two, all rows
def test_the_span_of_rows_transposed_at_once_does_not_change_the_bits(span_kb, monkeypatch, isa):
    """The rows a thread transposes at once (set by the L2's size, here forced) change the
    order of the loops, not the chain per element: exact on small integers, and the bits of
    the default span on random values."""
    x = torch.randn(400, 48, generator=_gen(14))
    w = torch.randn(21, 48, generator=_gen(15))  # 21: tiles and scalar columns
    xi = torch.randint(-8, 9, (400, 48), generator=_gen(16)).float()
    wi = torch.randint(-8, 9, (21, 48), generator=_gen(17)).float()
    whole = _gemm(x, w)
    monkeypatch.setenv("PAGEDKV_GEMM_SPAN_KB", span_kb)
    assert torch.equal(_gemm(x, w), whole)
    assert torch.equal(_gemm(xi, wi).double(), xi.double() @ wi.double().t())


def test_what_it_cannot_read_goes_to_mkl():
    x = torch.randn(70, 12)  # in % 8 != 0
    assert gemm_product(x, torch.randn(6, 12), None) is None
    x = torch.randn(16, 70).t()  # not contiguous
    assert gemm_product(x, torch.randn(6, 16), None) is None
    x = torch.randn(70, 16, dtype=torch.bfloat16)
    assert gemm_product(x, torch.randn(6, 16, dtype=torch.bfloat16), None) is None
    residual = torch.randn(6, 70).t()  # a residual the epilogue cannot take
    assert gemm_product(torch.randn(70, 16), torch.randn(6, 16), None, residual) is None
