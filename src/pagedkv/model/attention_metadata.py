"""``AttentionMetadata``: the layout of one step's batch, as the engine hands it to the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch layout, shared by every layer. The model reads it and never mutates it.

    slot_mapping:     int64 ``[num_tokens]``; where each new token's K/V is written.
    block_tables:     int32 ``[num_seqs, max_blocks]``; physical block ids per sequence, padded
                      with 0; must cover ``ceil(context_lens.max() / block_size)`` blocks.
    context_lens:     int32 ``[num_seqs]``; tokens of each sequence after this step (cached
                      prefix + new tokens).
    query_start_loc:  int32 ``[num_seqs + 1]``; cumulative new-token counts, starting at 0. Every
                      sequence has >= 1 new token; they are the last of its context.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
