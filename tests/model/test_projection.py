"""``layers.Projection``: the column-sharded path (one shard a thread) computes ``x @ W (+ b)``
exactly as the plain matmul does, at every row count and thread count, and follows a
replaced weight."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import layers
from pagedkv.model.layers import Projection


@pytest.fixture
def threads():
    """Sets torch's thread count for one test and restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _projection(in_features: int, out_features: int, bias: bool, seed: int) -> Projection:
    gen = torch.Generator().manual_seed(seed)
    module = Projection(in_features, out_features, bias=bias)
    module.weight_t = torch.nn.Parameter(
        torch.randn(in_features, out_features, generator=gen), requires_grad=False
    )
    if bias:
        module.bias = torch.nn.Parameter(torch.randn(out_features, generator=gen), False)
    return module


@pytest.mark.parametrize("num_threads", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 2, 7, layers.SHARDED_MAX_ROWS, layers.SHARDED_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_output_equals_the_plain_matmul(threads, num_threads, rows, bias):
    threads(num_threads)
    module = _projection(48, 96, bias, seed=rows)  # 96 columns: 1, 2, 3 and 4 shards
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(1))
    want = x @ module.weight_t + (module.bias if bias else 0)
    got = module(x)
    sharded = num_threads > 1 and rows <= layers.SHARDED_MAX_ROWS
    assert (module._shards is not None) == sharded  # which path ran
    assert got.shape == (rows, 96) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_columns_that_do_not_split_evenly_take_the_plain_matmul(threads):
    threads(2)
    module = _projection(16, 35, bias=True, seed=0)  # 35 columns: no two equal shards
    x = torch.randn(1, 16)
    torch.testing.assert_close(module(x), x @ module.weight_t + module.bias)
    assert module._shards is None  # never built


def test_a_replaced_weight_or_thread_count_is_followed(threads):
    threads(2)
    module = _projection(32, 64, bias=True, seed=0)
    x = torch.randn(1, 32)
    module(x)
    module.weight_t = torch.nn.Parameter(torch.randn(32, 64), requires_grad=False)
    torch.testing.assert_close(module(x), x @ module.weight_t + module.bias)
    module.bias = torch.nn.Parameter(torch.randn(64), requires_grad=False)
    torch.testing.assert_close(module(x), x @ module.weight_t + module.bias)
    threads(4)
    torch.testing.assert_close(module(x), x @ module.weight_t + module.bias)
    assert module._shards[3].shape == (4, 32, 16)
