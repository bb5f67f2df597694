"""write_kv and copy_blocks against torch: the whole expected pool is built with index_copy_ /
plain indexing on a clone, so a write outside its slots or blocks shows as well as a missed one.
Runs under the Triton interpreter (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.errors import UsageError
from pagedkv.model.triton.block_copy import copy_blocks
from pagedkv.model.triton.kv_write import write_kv

from .fused_support import round_bf16_to_nearest_even


def shuffled_slots(num_blocks, block_size, num_tokens, gen):
    """Slots of ``num_tokens`` consecutive positions laid over shuffled block ids."""
    ids = torch.randperm(num_blocks, generator=gen)
    positions = torch.arange(num_tokens)
    return ids[positions // block_size] * block_size + positions % block_size


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim"), [(16, 2, 64), (12, 1, 128), (1, 3, 16)]
)
def test_write_kv_shuffled_slots_with_padding(block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 8, 7 if block_size == 1 else 2 * block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slots = shuffled_slots(num_blocks, block_size, num_tokens, gen)
    slots[[1, num_tokens - 1]] = -1  # padding tokens: their rows go nowhere
    valid = slots >= 0
    expected_k = k_cache.clone().view(-1, num_kv_heads, head_dim)
    expected_k.index_copy_(0, slots[valid], k[valid])
    expected_v = v_cache.clone().view(-1, num_kv_heads, head_dim)
    expected_v.index_copy_(0, slots[valid], v[valid])

    write_kv(k, v, k_cache, v_cache, slots)

    assert torch.equal(k_cache, expected_k.view(shape))
    assert torch.equal(v_cache, expected_v.view(shape))


@pytest.fixture
def interpreter_rounds_to_nearest_even(monkeypatch):
    """The interpreter's fp32 -> bf16 cast rounds as a GPU's does (``fused_support``), so the
    stored bits can be compared exactly."""
    round_bf16_to_nearest_even(monkeypatch)


@pytest.mark.usefixtures("interpreter_rounds_to_nearest_even")
def test_write_kv_casts_fp32_input_into_a_bf16_cache():
    gen = torch.Generator().manual_seed(1)
    shape = (4, 16, 1, 64)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16)
    v_cache = torch.zeros(shape, dtype=torch.bfloat16)
    k = torch.randn(20, 1, 64, generator=gen)
    v = torch.randn(20, 1, 64, generator=gen)
    slots = shuffled_slots(4, 16, 20, gen)
    expected = torch.zeros(shape, dtype=torch.bfloat16).view(-1, 1, 64)

    write_kv(k, v, k_cache, v_cache, slots)

    assert torch.equal(
        k_cache.view(-1, 1, 64), expected.clone().index_copy_(0, slots, k.bfloat16())
    )
    assert torch.equal(
        v_cache.view(-1, 1, 64), expected.clone().index_copy_(0, slots, v.bfloat16())
    )


def test_write_kv_refuses_a_head_dim_that_is_not_a_power_of_two():
    cache = torch.zeros(2, 16, 1, 80)
    rows = torch.zeros(1, 1, 80)
    with pytest.raises(UsageError):
        write_kv(rows, rows, cache, cache, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim"),
    [(1, 3, 8), (16, 2, 64), (12, 1, 80)],  # 24, 2048 (two chunks) and 960 elements a block
)
def test_copy_blocks_over_shuffled_ids(block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks = 10
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)
    src, dst = ids[:3], ids[3:6]  # three forks; ids[6:] are neither and must stay as they are
    expected = cache.clone()
    expected[dst] = cache[src]

    copy_blocks(cache, src, dst)

    assert torch.equal(cache, expected)


def test_copy_blocks_with_no_pairs_changes_nothing():
    cache = torch.randn(3, 16, 1, 16)
    before = cache.clone()
    copy_blocks(cache, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim"),
    [(16, 2, 64), (12, 1, 80), (64, 2, 16)],  # a prefix ends inside a chunk and across chunks
)
def test_copy_blocks_copies_only_the_first_slots_of_each_pair(block_size, num_kv_heads, head_dim):
    """A partial prefix hit's copy: slots [0, n) of each source block, the rest of the
    destination block untouched (a slot-by-slot loop is the reference)."""
    gen = torch.Generator().manual_seed(block_size + 1)
    cache = torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen)
    src = torch.tensor([5, 0, 3])
    dst = torch.tensor([1, 6, 2])
    counts = torch.tensor([1, block_size - 1, block_size // 2])
    expected = cache.clone()
    for s, d, n in zip(src.tolist(), dst.tolist(), counts.tolist(), strict=True):
        for slot in range(n):
            expected[d, slot] = cache[s, slot]

    copy_blocks(cache, src, dst, counts)

    assert torch.equal(cache, expected)
