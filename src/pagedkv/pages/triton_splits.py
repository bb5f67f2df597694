"""How many parts pagedkv's Triton paged decode splits each sequence's context into: the rule
the kernel launches with (``model/triton/decode_split.py``) and the simulator's clock prices
with (``sim/decode_law.py``). Pure integer math, no torch, so both read this one copy.

Why split at all: decode has one query token per sequence, so the one-pass kernel launches
only ``num_seqs * num_kv_heads`` programs; a small batch with long contexts leaves most SMs
idle while a few programs walk thousands of blocks. Splitting the context multiplies the
programs, at the price of a second launch and a write + read of fp32 partials.
"""

from __future__ import annotations

PROGRAMS_PER_SM = 2  # below this many resident programs per SM, memory latency goes unhidden
MIN_BLOCKS_PER_SPLIT = 4  # a shorter split costs more in its partial's write and reduce
MAX_SPLITS = 64  # the reduction holds [splits, D] partials in one tile


def decode_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, block_size: int, num_sms: int
) -> int:
    """How many splits a decode step should use (1 = the one-pass kernel).

    Split only when the one-pass grid, ``num_seqs * num_kv_heads`` programs, would leave the SMs
    under-filled (fewer than ``PROGRAMS_PER_SM`` programs per SM) and the longest context is
    long enough: then choose the splits so that programs * splits ~= PROGRAMS_PER_SM * num_sms
    (rounded down, never more programs than that), capped so that each split of the longest
    context still spans ``MIN_BLOCKS_PER_SPLIT`` blocks, and at ``MAX_SPLITS``. Splitting
    costs a second launch and a write + read of fp32 partials, which only pays when programs
    would otherwise idle and each split has enough blocks to amortise its partial.

    E.g. 1 sequence x 8 KV heads, 4096 tokens in blocks of 16 (256 blocks), 132 SMs:
    264 // 8 = 33 splits, 256 // 4 = 64 allow it: 33.
    """
    programs = num_seqs * num_kv_heads
    target_programs = PROGRAMS_PER_SM * num_sms
    if programs <= 0 or programs >= target_programs or block_size <= 0:
        return 1
    num_blocks = -(-max_context_len // block_size)
    splits = min(target_programs // programs, num_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)
    return max(1, splits)
