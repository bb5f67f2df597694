"""``projection.Projection``: the column-sharded path (one shard a thread) computes ``x @ W (+ b)``
exactly as the plain matmul does, at every row count and thread count, and follows a
replaced weight; so do its residual add and its halves, which read the shards in place."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import projection
from pagedkv.model.projection import Projection


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
@pytest.mark.parametrize(
    "rows", [1, 2, 7, projection.SHARDED_MAX_ROWS, projection.SHARDED_MAX_ROWS + 1]
)
@pytest.mark.parametrize("bias", [False, True])
def test_output_equals_the_plain_matmul(threads, num_threads, rows, bias):
    threads(num_threads)
    module = _projection(48, 96, bias, seed=rows)  # 96 columns: 1, 2, 3 and 4 shards
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(1))
    want = x @ module.weight_t + (module.bias if bias else 0)
    got = module(x)
    sharded = num_threads > 1 and rows <= projection.SHARDED_MAX_ROWS
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


@pytest.mark.parametrize("num_threads", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 5, projection.SHARDED_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_added_to_a_residual_and_halves_equal_the_plain_matmul(threads, num_threads, rows, bias):
    threads(num_threads)
    module = _projection(40, 96, bias, seed=rows)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 40, generator=gen)
    residual = torch.randn(rows, 96, generator=gen)
    want = x @ module.weight_t + (module.bias if bias else 0)

    added = module.added_to(residual, x)
    assert added.shape == (rows, 96) and added.is_contiguous()
    torch.testing.assert_close(added, residual + want, rtol=1e-5, atol=1e-5)
    first, second = module.halves(x)
    assert first.shape == second.shape == (rows, 48)
    torch.testing.assert_close(first, want[:, :48], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, want[:, 48:], rtol=1e-5, atol=1e-5)
    assert (module._shards is not None) == (num_threads > 1 and rows <= projection.SHARDED_MAX_ROWS)


def test_a_residual_that_is_not_contiguous_is_added_all_the_same(threads):
    threads(2)
    module = _projection(16, 32, bias=False, seed=0)
    x = torch.randn(6, 16)
    residual = torch.randn(32, 6).t()  # a transposed view
    torch.testing.assert_close(module.added_to(residual, x), residual + x @ module.weight_t)
    assert module._shards is not None


def test_the_residual_and_input_are_left_as_they_were(threads):
    threads(2)
    module = _projection(16, 32, bias=True, seed=0)
    x, residual = torch.randn(6, 16), torch.randn(6, 32)
    x_before, residual_before = x.clone(), residual.clone()
    module.added_to(residual, x)
    module.halves(x)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("num_threads", [2, 3])
def test_a_model_step_at_several_threads_matches_one_thread(threads, embedded, num_threads):
    """The embedded model's layers (the projections' adds and halves included: 3 threads have
    no halves of shards) at 1 and at 2-3 threads: a 7-token prompt, then one decode row."""
    from tests.model.helpers import Chunk, run_steps

    _, model, _ = embedded
    sequence = [[1, 504, 3137, 282, 260, 3458, 30, 216]]
    steps = [[Chunk(0, 0, 7)], [Chunk(0, 7, 8)]]
    threads(1)
    want = run_steps(model, sequence, steps, block_size=4, max_len=8)
    threads(num_threads)
    got = run_steps(model, sequence, steps, block_size=4, max_len=8)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
