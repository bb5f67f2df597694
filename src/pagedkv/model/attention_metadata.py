"""``AttentionMetadata``: the layout of one step's batch, as the engine hands it to the model."""

from __future__ import annotations

from collections.abc import Sequence
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


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    new_token_counts: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, AttentionMetadata]:
    """``(positions, metadata)`` for a step from per-sequence Python lists.

    Sequence i contributes its last ``new_token_counts[i]`` tokens (positions
    ``context_lens[i] - new_token_counts[i]`` .. ``context_lens[i] - 1``), in list order; their
    slots come from ``block_tables[i]``, which must cover ``context_lens[i]`` tokens.
    """
    if not (len(block_tables) == len(context_lens) == len(new_token_counts) >= 1):
        raise ValueError("need one block table, context length and new-token count per sequence")
    positions: list[int] = []
    slots: list[int] = []
    for table, ctx, new in zip(block_tables, context_lens, new_token_counts, strict=True):
        if not 1 <= new <= ctx or len(table) * block_size < ctx:
            raise ValueError(f"bad sequence: {new} new of {ctx} tokens in {len(table)} blocks")
        for pos in range(ctx - new, ctx):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for new in new_token_counts:
        starts.append(starts[-1] + new)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )
    return torch.tensor(positions, dtype=torch.int64, device=device), meta
