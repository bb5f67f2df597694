"""RoPE + KV write in one launch against the torch path it replaces: ``layers.apply_rotary``
on the ``[T, Hq + Hkv, D]`` view of the QKV product (``DecoderLayer``'s layout), cos/sin from
``RotaryEmbedding.cos_sin``, then the rotated K and V written into the pool by slot. Under the
Triton interpreter on tiny shapes.

Equality: bit for bit, fp32 and bf16 alike: the kernel does torch's arithmetic in torch's order
(``x * cos`` rounded, then ``addcmul``'s multiply-add, which torch's CPU kernel contracts to one
FMA, as the kernel's ``tl.fma``). The whole pool is compared, so a write outside the new
tokens' slots (or one for a padding token) shows as well as a missed one.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.errors import UsageError
from pagedkv.model.layers import RotaryEmbedding, apply_rotary
from pagedkv.model.triton.rope_kv_write import rope_write_kv
from pagedkv.pages.shape import Llama3RopeScaling

from .fused_support import round_bf16_to_nearest_even


@pytest.fixture(autouse=True)
def _bf16_rounds_to_nearest_even(monkeypatch):
    round_bf16_to_nearest_even(monkeypatch)


def make_step(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
              cache_dtype=None):  # fmt: skip
    """qkv [T, (Hq + 2 Hkv) D], cos/sin at random positions up to 8k (llama3-scaled for
    variety), pools of 6 blocks of random values and shuffled slots with token 1 padding."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen)
    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 8192) if seed % 2 else None
    cos, sin = RotaryEmbedding(head_dim, 500000.0, scaling).cos_sin(positions, dtype)
    shape = (6, block_size, num_kv_heads, head_dim)
    cache_dtype = cache_dtype or dtype
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    if num_tokens > 1:
        slots[1] = -1
    return qkv.to(dtype), cos, sin, k_cache, v_cache, slots


def torch_reference(qkv, cos, sin, k_cache, v_cache, slots, num_heads):
    """(q, k, v, expected k_cache, expected v_cache) the torch way."""
    num_tokens = qkv.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    width = (num_heads + num_kv_heads) * head_dim
    qk = apply_rotary(qkv[:, :width].view(num_tokens, -1, head_dim), cos, sin)
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    v = qkv[:, width:].view(num_tokens, num_kv_heads, head_dim)
    live = slots >= 0
    want_k = k_cache.clone().view(-1, num_kv_heads, head_dim)
    want_k[slots[live]] = k[live].to(k_cache.dtype)
    want_v = v_cache.clone().view(-1, num_kv_heads, head_dim)
    want_v[slots[live]] = v[live].to(v_cache.dtype)
    return q, k, v, want_k.view(k_cache.shape), want_v.view(v_cache.shape)


@pytest.mark.parametrize(
    ("dtype", "num_tokens", "num_heads", "num_kv_heads", "head_dim", "block_size", "head_block"),
    [  # head_block 4 / 2: a token's heads over several programs, the last one partial
        (torch.float32, 1, 1, 1, 64, 16, None),
        (torch.float32, 5, 4, 2, 128, 3, None),
        (torch.float32, 7, 9, 3, 64, 16, 4),
        (torch.bfloat16, 3, 8, 1, 128, 1, None),
        (torch.bfloat16, 5, 4, 4, 64, 32, 2),
        (torch.bfloat16, 7, 9, 3, 64, 16, None),
    ],
)
def test_rope_and_kv_write_are_bit_equal_to_torch(
    dtype, num_tokens, num_heads, num_kv_heads, head_dim, block_size, head_block
):
    step = make_step(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                     seed=num_tokens + head_dim)  # fmt: skip
    qkv, cos, sin, k_cache, v_cache, slots = step
    want_q, want_k, want_v, want_kc, want_vc = torch_reference(*step, num_heads)

    q, k, v = rope_write_kv(
        qkv, cos, sin, k_cache, v_cache, slots, num_heads, head_block=head_block
    )

    assert q.shape == (num_tokens, num_heads, head_dim) and q.dtype == dtype
    assert torch.equal(q, want_q)
    assert torch.equal(k, want_k)
    assert torch.equal(v, want_v)
    assert torch.equal(k_cache, want_kc)
    assert torch.equal(v_cache, want_vc)


def test_in_place_overwrites_qk_columns_of_strided_rows():
    """``in_place``: Q/K rotated into qkv itself (rows of a wider tensor); V and the columns
    beyond the row stay; the returned views alias qkv."""
    qkv, cos, sin, k_cache, v_cache, slots = make_step(3, 4, 2, 64, 16, torch.float32, seed=5)
    wide = torch.randn(3, qkv.shape[1] + 64)
    wide[:, : qkv.shape[1]] = qkv
    before = wide.clone()
    view = wide[:, : qkv.shape[1]]
    want_q, want_k, _, want_kc, want_vc = torch_reference(
        qkv, cos, sin, k_cache.clone(), v_cache.clone(), slots, 4
    )

    q, k, v = rope_write_kv(view, cos, sin, k_cache, v_cache, slots, 4, in_place=True)

    assert q.data_ptr() == wide.data_ptr() and v.data_ptr() == wide[:, 6 * 64 :].data_ptr()
    assert torch.equal(wide[:, : 4 * 64].view(3, 4, 64), want_q)
    assert torch.equal(wide[:, 4 * 64 : 6 * 64].view(3, 2, 64), want_k)
    assert torch.equal(wide[:, 6 * 64 :], before[:, 6 * 64 :])  # V and beyond untouched
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)


def test_fp32_rows_into_a_bf16_pool_cast_as_write_kv_casts():
    step = make_step(5, 2, 1, 64, 16, torch.float32, seed=2, cache_dtype=torch.bfloat16)
    qkv, cos, sin, k_cache, v_cache, slots = step
    _, _, _, want_kc, want_vc = torch_reference(*step, 2)
    rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, 2)
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)


def test_all_padding_writes_nothing_and_no_tokens_launches_nothing():
    qkv, cos, sin, k_cache, v_cache, _ = make_step(2, 2, 1, 64, 16, torch.float32, seed=4)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    rope_write_kv(qkv, cos, sin, k_cache, v_cache, torch.full((2,), -1), 2)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    q, k, v = rope_write_kv(qkv[:0], cos[:0], sin[:0], k_cache, v_cache, torch.zeros(0), 2)
    assert q.shape == (0, 2, 64) and k.shape == (0, 1, 64) and v.shape == (0, 1, 64)


def test_refusals():
    qkv, cos, sin, k_cache, v_cache, slots = make_step(2, 2, 1, 64, 16, torch.float32, seed=6)
    with pytest.raises(ValueError, match="qkv"):
        rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, 3)  # the heads do not add up
    with pytest.raises(ValueError, match="cos"):
        rope_write_kv(qkv, cos.bfloat16(), sin, k_cache, v_cache, slots, 2)
    odd = torch.zeros(2, 16, 1, 80)
    with pytest.raises(UsageError):
        rope_write_kv(torch.zeros(2, 4 * 80), cos, sin, odd, odd, slots, 2)
