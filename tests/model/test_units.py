"""Small pieces checked against independent formulations."""

from __future__ import annotations

import torch

from pagedkv.model import allocate_kv_caches, copy_blocks
from pagedkv.model.gguf import unpermute_qk_rows


def _llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter writes: per head, rows i and i + d/2 become a pair."""
    d = w.shape[0] // num_heads
    out = torch.empty_like(w)
    for h in range(num_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def test_unpermute_inverts_llama_cpp_row_order():
    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_qk_rows(_llama_cpp_permute(w, 3), 3), w)
    b = torch.randn(2 * 4)
    assert torch.equal(unpermute_qk_rows(_llama_cpp_permute(b[:, None], 2)[:, 0], 2), b)


def test_copy_blocks_copies_every_layer():
    caches = allocate_kv_caches(2, num_blocks=4, block_size=3, num_kv_heads=1, head_dim=2)
    for k, v in caches:
        k[1].fill_(7.0)
        v[1].fill_(8.0)
    copy_blocks(caches, torch.tensor([[1, 3]]))
    for k, v in caches:
        assert torch.all(k[3] == 7.0) and torch.all(v[3] == 8.0)
        assert torch.all(k[2] == 0.0)
