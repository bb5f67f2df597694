"""What attention over latent records computes, in torch ops every backend shares: the per-head
weights of ``kv_b_proj`` (``LatentWeights``) and the two equal ways to attend over a context of
latent records ``[L, R + Dr]`` (the normalised compressed KV, then the rotated k_pe).

Absorbed (``absorb_queries`` ... ``expand_output``): a query head's nope part times W_UK (the
head's key rows of ``kv_b_proj``) is a vector in latent space, so the scores are the latent
query against the cached record itself (its rope part against k_pe), one shared "head" for all
query heads (MQA); the weighted sum of latents times W_UV (the head's value rows) is the
head's output. Nothing per head is materialised per key: what decode reads is the pool.

Decompressed (``decompress``): each latent of the context times ``kv_b_proj`` gives every
head's K nope part and V, K's rope part the shared k_pe; then ordinary attention. More work per
key, less per query: the way for a prompt (``MLADims.decompress_prefill``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv.pages.mla_shape import MLADims


class LatentWeights(NamedTuple):
    """``weight``: ``kv_b_proj``'s weight per head ``[H, Dn + Dv, R]`` (in the model dtype, on
    its device), and the dims. Views, read only."""

    weight: torch.Tensor
    dims: MLADims

    @property
    def w_uk(self) -> torch.Tensor:
        """``[H, Dn, R]``: a head's query nope part into latent space (from the right)."""
        return self.weight[:, : self.dims.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """``[H, Dv, R]``: a head's latent output into its value dims (transposed)."""
        return self.weight[:, self.dims.qk_nope_head_dim :]


def absorb_queries(q: torch.Tensor, latent: LatentWeights) -> torch.Tensor:
    """``[T, H, R + Dr]`` latent queries of ``q`` ``[T, H, Dn + Dr]`` (rope part rotated):
    ``q_nope @ W_UK`` per head, then the rope part as it is. A new tensor."""
    dims = latent.dims
    num_tokens, num_heads, _ = q.shape
    out = q.new_empty(num_tokens, num_heads, dims.record_width)
    # [H, T, Dn] @ [H, Dn, R] -> [H, T, R]: one batched product over the heads
    nope = torch.bmm(q[:, :, : dims.qk_nope_head_dim].transpose(0, 1), latent.w_uk)
    out[:, :, : dims.kv_lora_rank] = nope.transpose(0, 1)
    out[:, :, dims.kv_lora_rank :] = q[:, :, dims.qk_nope_head_dim :]
    return out


def expand_output(latent_out: torch.Tensor, latent: LatentWeights) -> torch.Tensor:
    """``[T, H * Dv]`` of the attention's latent output ``[T, H, R]``: ``o @ W_UV^T`` per head
    (what ``o_proj`` then reads). A new tensor."""
    heads_first = torch.bmm(latent_out.transpose(0, 1), latent.w_uv.transpose(1, 2))
    return heads_first.transpose(0, 1).reshape(latent_out.shape[0], -1)


def decompress(records: torch.Tensor, latent: LatentWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys ``[L, H, Dn + Dr]`` and values ``[L, H, Dv]`` of ``L`` latent records
    ``[L, R + Dr]``: ``kv_b_proj`` of the compressed part, k_pe shared by every head."""
    dims = latent.dims
    rank, nope = dims.kv_lora_rank, dims.qk_nope_head_dim
    num_heads = latent.weight.shape[0]
    kv = records[:, :rank] @ latent.weight.reshape(-1, rank).t()  # [L, H * (Dn + Dv)]
    kv = kv.view(records.shape[0], num_heads, -1)
    keys = records.new_empty(records.shape[0], num_heads, dims.qk_head_dim)
    keys[:, :, :nope] = kv[:, :, :nope]
    keys[:, :, nope:] = records[:, None, rank:]
    return keys, kv[:, :, nope:]
