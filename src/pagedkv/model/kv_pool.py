"""The KV pools: per layer, K and V of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``
(MHA), or one tensor of latent records ``[num_blocks, block_size, 1, kv_lora_rank +
qk_rope_head_dim]`` (MLA: ``(latents,)``), sized by one object, the page format
(``pages/page_format.py``: attention kind, block size, layers, KV heads, head dim or the
latent's dims, KV dtype), so every pool of an engine (device, swap, host tier) has the same
pages. A layer's pool is a tuple of ``pools_per_layer`` tensors; code that moves blocks walks
the tuple, whatever its length."""

from __future__ import annotations

import torch

from pagedkv.pages.layout import KVLayout, mha_layout, pools_per_layer
from pagedkv.pages.page_format import PageFormat
from pagedkv.units import check_block_size

KVCache = tuple[torch.Tensor, ...]  # (k, v): MHA; (latents,): MLA


# The engine's KV dtypes (a page format's ``kv_dtype``) as torch dtypes.
TORCH_KV_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def torch_kv_dtype(page: PageFormat) -> torch.dtype:
    """The torch dtype of ``page``'s K and V values (ValueError for a format torch has none
    of, e.g. a quantized one)."""
    if page.kv_dtype not in TORCH_KV_DTYPES:
        raise ValueError(f"no torch pool for KV dtype {page.kv_dtype!r}")
    return TORCH_KV_DTYPES[page.kv_dtype]


def allocate_kv_caches(
    page: PageFormat, num_blocks: int, device: torch.device | str = "cpu"
) -> list[KVCache]:
    """Zero-filled pools per layer of ``page`` (its block size, heads, head dim and dtype):
    ``(k, v)`` of ``[num_blocks, block_size, num_kv_heads, head_dim]``, or MLA's ``(latents,)``.

    Zeros matter: masked-out slots are still multiplied by a zero weight, and garbage NaNs from
    uninitialised memory would poison real rows. The caller owns the tensors.
    """
    shape, dtype = _pool_shape(page, num_blocks), torch_kv_dtype(page)
    count = pools_per_layer(page.attention)
    return [
        tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(count))
        for _ in range(page.num_layers)
    ]


def allocate_host_kv_caches(
    page: PageFormat, num_blocks: int, pin_memory: bool = False
) -> list[KVCache]:
    """Host ``(k, v)`` pools per layer in ``page``'s block layout, for blocks that are only
    read after a copy wrote them (swap space, the host tier): left uninitialised
    (``torch.empty``: the memory is committed page by page as copies touch it); ``pin_memory``
    for faster transfers to and from a GPU. The caller owns the tensors."""
    shape, dtype = _pool_shape(page, num_blocks), torch_kv_dtype(page)
    count = pools_per_layer(page.attention)
    return [
        tuple(torch.empty(shape, dtype=dtype, pin_memory=pin_memory) for _ in range(count))
        for _ in range(page.num_layers)
    ]


def copy_pool_rows(
    pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_tokens: torch.Tensor | None = None
) -> None:
    """``pool[dst[i]] = pool[src[i]]`` (whole blocks of one K or V pool: copy-on-write), with
    torch ops; the rows are read before any is written. ``num_tokens`` (int64 ``[n]``): only
    slots ``[0, num_tokens[i])`` of each block (a partial prefix hit), the rest of ``dst[i]``
    kept; a blend of whole rows, so no host value is read (no device sync)."""
    rows = pool.index_select(0, src)
    if num_tokens is not None:
        slots = torch.arange(pool.shape[1], device=pool.device)
        keep = (slots[None, :] < num_tokens[:, None]).view(-1, pool.shape[1], 1, 1)
        rows = torch.where(keep, rows, pool.index_select(0, dst))
    pool.index_copy_(0, dst, rows)


def _pool_shape(page: PageFormat, num_blocks: int) -> tuple[int, int, int, int]:
    """One layer's K (or V, or latent) pool shape; ValueError for a bad block count or a page
    whose record bytes are not this pool's (``pages/layout.py`` owns them)."""
    check_block_size(page.block_size)
    if num_blocks < 1:
        raise ValueError(f"need num_blocks >= 1, got {num_blocks}")
    heads, width = page.num_kv_heads, page.head_dim
    if page.attention == "mla":  # one "head": the latent, then k_pe
        heads, width = 1, page.kv_lora_rank + page.qk_rope_head_dim
    element_bytes = torch.empty((), dtype=torch_kv_dtype(page)).element_size()
    row_bytes = pools_per_layer(page.attention) * heads * width * element_bytes
    if row_bytes * page.num_layers != page.record_bytes:
        raise ValueError(
            f"a {page.attention} pool of {row_bytes} bytes a token and layer is not the "
            f"page's {page.record_bytes} bytes a token"
        )
    return (num_blocks, page.block_size, heads, width)


def page_of_pools(kv_caches: list[KVCache]) -> PageFormat:
    """The page format of these pools (read off the tensors)."""
    return PageFormat.from_layout(pool_layout(kv_caches), kv_caches[0][0].shape[1])


def pool_layout(kv_caches: list[KVCache]) -> KVLayout:
    """The page layout of these MHA pools (``pages/layout.py`` owns their record and block
    bytes): one layer per ``(k, v)`` pair, KV heads, head dim and dtype read off the tensors.
    ValueError for MLA's latent pools (their tensors do not say where the latent ends)."""
    if len(kv_caches[0]) != 2:
        raise ValueError("the layout of latent pools is their page format's, not the tensors'")
    k = kv_caches[0][0]
    dtype_name = str(k.dtype).removeprefix("torch.")  # "float32": a spelling get_kv_dtype knows
    return mha_layout(len(kv_caches), k.shape[2], k.shape[3], dtype_name)
