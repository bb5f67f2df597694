"""The four ledgers of a block size B, and the memory waste W(B), as plain formulas.

Every function here is a small closed form from the first article (seeds/000): the planner
composes them per block size, and the tests check each one by hand. Units are in the names:
``*_tokens`` / ``*_slots`` count token slots, ``*_bytes`` count bytes, ``block_size`` is tokens.

1. Block table:   entries = sum ceil(L_i / B) ~ N/B + K; padded table = 4 * K * ceil(L_max / B).
2. Fragmentation: expected K * (B - 1) / 2 empty slots; exactly sum (ceil(L_i / B) * B - L_i).
3. Prefix reuse:  floor(P / B) * B tokens reused per hit, (P mod B) lost per hit. With a
                  prefix-match unit U dividing B (partial-block reuse): floor(P / U) * U reused,
                  (P mod U) lost, and (P mod B) - (P mod U) of the reused tokens copied out of a
                  partially matched block (time, not memory: the block is the sequence's own).
4. Hard limits:   see ``constraints.py`` (backends, alignment, int32 offsets).

W(B) = c * K * (B - 1) / 2  +  4 * K * ceil(L_max / B)  +  c * (P mod U) * H   (bytes, U = B
without partial reuse), summed per block size by ``plan.build_plan`` (``PlanRow.total_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedkv.errors import UsageError
from pagedkv.units import check_block_size

TABLE_ENTRY_BYTES = 4  # block tables hold int32 physical block ids


# --- ledger 1: the block table -------------------------------------------------------------


def exact_table_entries(seq_lens_tokens: Sequence[int], block_size: int) -> int:
    """Block-table entries of sequences of these lengths: sum of ceil(L_i / B)."""
    check_block_size(block_size)
    return sum(-(-length // block_size) for length in seq_lens_tokens)


def expected_table_entries(num_seqs: int, mean_len_tokens: float, block_size: int) -> float:
    """Expected entries for K sequences of mean length L: N/B + K * (B - 1) / (2B).

    Each sequence's last block is on average (B - 1)/2 slots short of full, so the allocated
    slots are N + K(B - 1)/2 and the entries are that over B: the article's "N/B + K" is the
    upper bound (every last block counted whole).
    """
    check_block_size(block_size)
    total_tokens = num_seqs * mean_len_tokens
    return total_tokens / block_size + num_seqs * (block_size - 1) / (2 * block_size)


def padded_table_bytes(num_seqs: int, max_len_tokens: int, block_size: int) -> int:
    """Bytes of the padded ``[K, ceil(L_max / B)]`` int32 block table that kernels receive."""
    check_block_size(block_size)
    return TABLE_ENTRY_BYTES * num_seqs * -(-max_len_tokens // block_size)


# --- ledger 2: internal fragmentation ------------------------------------------------------


def expected_fragmentation_slots(num_seqs: int, block_size: int) -> float:
    """Expected empty slots in the last blocks of K live sequences: K * (B - 1) / 2."""
    check_block_size(block_size)
    return num_seqs * (block_size - 1) / 2


def exact_fragmentation_slots(seq_lens_tokens: Sequence[int], block_size: int) -> int:
    """Allocated minus used slots for sequences of these lengths."""
    check_block_size(block_size)
    return sum(-(-length // block_size) * block_size - length for length in seq_lens_tokens)


# --- ledger 3: prefix reuse ----------------------------------------------------------------


def prefix_reuse_tokens(prefix_len_tokens: int, block_size: int) -> int:
    """Tokens of a shared prefix of length P that a full-block cache reuses: floor(P/B) * B."""
    check_block_size(block_size)
    return prefix_len_tokens // block_size * block_size


def prefix_lost_tokens(prefix_len_tokens: int, block_size: int) -> int:
    """Tokens of the shared prefix that must be recomputed per hit: P mod B."""
    check_block_size(block_size)
    return prefix_len_tokens % block_size


def prefix_copy_tokens(prefix_len_tokens: int, block_size: int, unit: int) -> int:
    """Tokens of a shared prefix of length P reused from its partially matched block when a
    prefix match counts in units of ``unit`` (U, dividing B): (P mod B) - (P mod U); a copy
    unless the block is claimed in place."""
    check_block_size(block_size)
    if unit < 1 or block_size % unit:
        raise UsageError(f"the prefix match unit {unit} must divide the block size {block_size}")
    return prefix_len_tokens % block_size - prefix_len_tokens % unit


def mean_prefix_copy_tokens(prefix_lens_tokens: Sequence[int], block_size: int, unit: int) -> float:
    """Mean of ``prefix_copy_tokens`` over the prefix distribution (0.0 for an empty one)."""
    if not prefix_lens_tokens:
        return 0.0
    copied = [prefix_copy_tokens(p, block_size, unit) for p in prefix_lens_tokens]
    return sum(copied) / len(copied)


def mean_prefix_reuse_rate(prefix_lens_tokens: Sequence[int], block_size: int) -> float:
    """Mean over requests of floor(P/B)*B / P (prefixes of length 0 are skipped).

    This is the article's "mean reuse rate" for a P distribution: the mean of per-request
    ratios, not the ratio of sums. Returns 1.0 when no request has a prefix (nothing is lost).
    """
    ratios = [prefix_reuse_tokens(p, block_size) / p for p in prefix_lens_tokens if p > 0]
    return sum(ratios) / len(ratios) if ratios else 1.0


def mean_prefix_reuse_tokens(prefix_lens_tokens: Sequence[int], block_size: int) -> float:
    """Mean of floor(P/B) * B over the prefix distribution (0.0 for an empty one)."""
    if not prefix_lens_tokens:
        return 0.0
    reused = [prefix_reuse_tokens(p, block_size) for p in prefix_lens_tokens]
    return sum(reused) / len(reused)


def mean_prefix_lost_tokens(prefix_lens_tokens: Sequence[int], block_size: int) -> float:
    """Mean of (P mod B) over the prefix distribution (0.0 for an empty one)."""
    if not prefix_lens_tokens:
        return 0.0
    lost = [prefix_lost_tokens(p, block_size) for p in prefix_lens_tokens]
    return sum(lost) / len(lost)


# --- W(B) and the costs beside it ----------------------------------------------------------


def swap_transfers(num_bytes: int, block_bytes: int) -> int:
    """Block transfers needed to move ``num_bytes`` of KV (swap / offload): ceil(X / block)."""
    if block_bytes < 1:
        raise UsageError(f"block_bytes must be >= 1, got {block_bytes}")
    return -(-num_bytes // block_bytes)


def kernel_block_iterations(len_tokens: float, block_size: int) -> int:
    """Blocks a paged decode kernel loops over for one sequence of this length: ceil(L / B)."""
    check_block_size(block_size)
    return math.ceil(len_tokens / block_size)


# --- capacity: reserved versus paged -------------------------------------------------------


def reserved_capacity_seqs(pool_bytes: int, record_bytes: int, max_len_tokens: int) -> int:
    """Sequences that fit when each one reserves ``max_len`` contiguous slots."""
    return pool_bytes // (record_bytes * max_len_tokens)


def paged_capacity_seqs(
    pool_bytes: int, record_bytes: int, mean_len_tokens: float, block_size: int
) -> int:
    """Sequences of mean length L that fit when blocks are allocated on demand.

    Each costs L plus its expected last-block gap (B - 1)/2 slots; the second article's
    "in theory" count (no scheduling headroom, no length variance).
    """
    check_block_size(block_size)
    slots_per_seq = mean_len_tokens + (block_size - 1) / 2
    return math.floor(pool_bytes / (record_bytes * slots_per_seq))


def reserved_waste_rate(mean_len_tokens: float, max_len_tokens: int) -> float:
    """Share of a max_len reservation that a mean-length request leaves unused: 1 - L / L_max."""
    return 1.0 - mean_len_tokens / max_len_tokens
