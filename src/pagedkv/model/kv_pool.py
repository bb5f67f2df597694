"""The KV pools: per layer, K and V of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

from __future__ import annotations

import torch

from pagedkv.pages.layout import KVLayout, mha_layout
from pagedkv.units import check_block_size

KVCache = tuple[torch.Tensor, torch.Tensor]


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[KVCache]:
    """Zero-filled ``(k, v)`` pools per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Zeros matter: masked-out slots are still multiplied by a zero weight, and garbage NaNs from
    uninitialised memory would poison real rows. The caller owns the tensors.
    """
    shape = _pool_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def allocate_host_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    pin_memory: bool = False,
) -> list[KVCache]:
    """Host ``(k, v)`` pools per layer in the device pool's block layout, for blocks that are
    only read after a copy wrote them (swap space, the host tier): left uninitialised
    (``torch.empty``: the memory is committed page by page as copies touch it); ``pin_memory``
    for faster transfers to and from a GPU. The caller owns the tensors."""
    shape = _pool_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.empty(shape, dtype=dtype, pin_memory=pin_memory),
            torch.empty(shape, dtype=dtype, pin_memory=pin_memory),
        )
        for _ in range(num_layers)
    ]


def _pool_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """One layer's K (or V) pool shape; ValueError for a bad block size or count."""
    check_block_size(block_size)
    if num_blocks < 1:
        raise ValueError(f"need num_blocks >= 1, got {num_blocks}")
    return (num_blocks, block_size, num_kv_heads, head_dim)


def pool_layout(kv_caches: list[KVCache]) -> KVLayout:
    """The page layout of these pools (``pages/layout.py`` owns their record and block bytes):
    one layer per ``(k, v)`` pair, KV heads, head dim and dtype read off the tensors."""
    k = kv_caches[0][0]
    dtype_name = str(k.dtype).removeprefix("torch.")  # "float32": a spelling get_kv_dtype knows
    return mha_layout(len(kv_caches), k.shape[2], k.shape[3], dtype_name)
