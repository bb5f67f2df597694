"""How many parts pagedkv's Triton paged decode splits each sequence's context into: the rule
the kernel launches with (``model/triton/decode_split.py``) and the simulator's clock prices
with. Pure integer math, no torch, so both read this one copy.

Why split at all: decode has one query token per sequence, so the one-pass kernel launches
only ``num_seqs * num_kv_heads`` programs; a small batch with long contexts leaves most SMs
idle while a few programs walk thousands of tiles. Splitting the context multiplies the
programs, at the price of a second launch and a write + read of fp32 partials.

The numbers rest on the H200 ledger (``../shared/data/gpu_check_h200/``, decode attention at
32/8 heads of 128, bf16, the rule's split count against one pass, median of 20):

- wherever the rule split (batch 1 and 8: 8-64 programs on 132 SMs), splitting won, 1.2x to
  25x: batch 1 at 32k context, 0.04-0.14 of the one-pass time; batch 8, 0.28-0.85;
- at batch 1 and 1k context the shortest splits were the fastest: 16 splits of 64 tokens
  0.0134 ms, 8 of 128 0.0144, 4 of 256 0.0154, 2 of 512 0.0166 (one pass 0.023-0.080): a split
  of 64 tokens still amortises its partial, so ``MIN_TOKENS_PER_SPLIT`` is 64, in tokens now that
  a split is a run of tiles and no longer of blocks;
- at batch >= 32 (256+ programs, ~2 per SM) the rule never split, and one pass reached 86-103 %
  of the copy bandwidth at B >= 64: 2 programs per SM is enough to hide memory latency, so
  ``PROGRAMS_PER_SM`` stays 2.
The device check's ledger times the rule against one pass at every point, so the next run on
the tile kernels re-checks these three constants.
"""

from __future__ import annotations

PROGRAMS_PER_SM = 2  # below this many resident programs per SM, memory latency goes unhidden
MIN_TOKENS_PER_SPLIT = 64  # a shorter split costs more in its partial's write and reduce
MAX_SPLITS = 64  # the reduction holds [splits, D] partials in one tile


def decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many splits a decode step should use (1 = the one-pass kernel).

    Split only when the one-pass grid, ``num_seqs * num_kv_heads`` programs, would leave the SMs
    under-filled (fewer than ``PROGRAMS_PER_SM`` programs per SM) and the longest context is
    long enough: then choose the splits so that programs * splits ~= PROGRAMS_PER_SM * num_sms
    (rounded down, never more programs than that), capped so that each split of the longest
    context still spans ``MIN_TOKENS_PER_SPLIT`` tokens, and at ``MAX_SPLITS``. The block size
    plays no part: a split is a run of K/V tiles, whatever the page.

    E.g. 1 sequence x 8 KV heads, 4096 tokens, 132 SMs: 264 // 8 = 33 splits, 4096 // 64 = 64
    allow it: 33.
    """
    programs = num_seqs * num_kv_heads
    target_programs = PROGRAMS_PER_SM * num_sms
    if programs <= 0 or programs >= target_programs:
        return 1
    splits = min(target_programs // programs, max_context_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return max(1, splits)
