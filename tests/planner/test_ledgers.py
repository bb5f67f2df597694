"""The ledger formulas against hand-computed cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.planner import ledgers
from tests.planner.helpers import plan_json

LENS = [1, 16, 17, 100]  # at B=16: blocks 1, 1, 2, 7; empty slots 15, 0, 15, 12


def test_exact_table_entries_and_fragmentation():
    assert ledgers.exact_table_entries(LENS, 16) == 11
    assert ledgers.exact_fragmentation_slots(LENS, 16) == 42
    assert ledgers.exact_table_entries(LENS, 1) == sum(LENS)
    assert ledgers.exact_fragmentation_slots(LENS, 1) == 0


def test_expected_table_entries_lie_between_n_over_b_and_n_over_b_plus_k():
    # K=4, mean 100, B=16: 400/16 + 4 * 15/32 = 25 + 1.875
    assert ledgers.expected_table_entries(4, 100, 16) == pytest.approx(26.875)
    assert 400 / 16 < 26.875 < 400 / 16 + 4


def test_padded_table_bytes():
    # K=128, L_max=8192, B=8: 4 bytes * 128 * 1024 entries = 512 KiB (the article's table).
    assert ledgers.padded_table_bytes(128, 8192, 8) == 512 * 1024
    assert ledgers.padded_table_bytes(3, 17, 16) == 4 * 3 * 2


def test_expected_fragmentation():
    assert ledgers.expected_fragmentation_slots(128, 1) == 0
    assert ledgers.expected_fragmentation_slots(128, 16) == 128 * 7.5


def test_prefix_reuse():
    assert ledgers.prefix_reuse_tokens(1200, 32) == 1184
    assert ledgers.prefix_lost_tokens(1200, 32) == 16
    # mean of ratios, not ratio of sums: (64/100 + 128/130) / 2
    assert ledgers.mean_prefix_reuse_rate([100, 130], 64) == pytest.approx((0.64 + 128 / 130) / 2)
    assert ledgers.mean_prefix_reuse_rate([], 64) == 1.0
    assert ledgers.mean_prefix_lost_tokens([100, 130], 64) == (36 + 2) / 2


def test_waste_formula_through_the_plan():
    # c=4096, K=128, L_max=8192, P=1200, H=128, B=32:
    # 4096*128*15.5 + 4*128*256 + 4096*16*128 = 8126464 + 131072 + 8388608
    report = plan_json("--record-bytes", "4096", "--num-seqs", "128", "--max-len", "8192",
                       "--prefix-len", "1200", "--block-sizes", "32")  # fmt: skip
    assert report["rows"][0]["total_bytes"] == 16_646_144


def test_swap_and_kernel_iterations():
    assert ledgers.swap_transfers(2**30, 512 * 1024) == 2048
    assert ledgers.swap_transfers(1, 512 * 1024) == 1
    assert ledgers.kernel_block_iterations(2048, 16) == 128
    assert ledgers.kernel_block_iterations(2049, 16) == 129


def test_capacity():
    c = 131072  # Llama-3-8B fp16 record
    assert ledgers.reserved_capacity_seqs(58 * 2**30, c, 32768) == 14  # 58 / 4
    assert ledgers.paged_capacity_seqs(58 * 2**30, c, 6144, 1) == 77  # 58 / 0.75 = 77.3
    # Larger blocks cost (B-1)/2 slots more per sequence: at B=128, 58 GiB / 6207.5 records
    assert ledgers.paged_capacity_seqs(58 * 2**30, c, 6144, 128) == 76
    assert ledgers.reserved_waste_rate(6144, 32768) == pytest.approx(0.8125)


@pytest.mark.parametrize(
    "call",
    [
        lambda: ledgers.exact_table_entries([1], 0),
        lambda: ledgers.expected_fragmentation_slots(1, 0),
        lambda: ledgers.prefix_reuse_tokens(10, -1),
        lambda: ledgers.swap_transfers(10, 0),
    ],
)
def test_block_size_below_one_is_refused(call):
    with pytest.raises(ValueError):
        call()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=40), st.integers(1, 256))
def test_exact_ledgers_account_for_every_allocated_slot(seq_lens, block_size):
    entries = ledgers.exact_table_entries(seq_lens, block_size)
    frag = ledgers.exact_fragmentation_slots(seq_lens, block_size)
    assert entries * block_size == sum(seq_lens) + frag
    assert 0 <= frag <= len(seq_lens) * (block_size - 1)


@pytest.mark.parametrize("block_size", [1, 8, 16, 128])
def test_expected_fragmentation_is_the_mean_over_all_residues(block_size):
    # One sequence per residue class mod B: the exact waste averages to (B - 1)/2 per sequence.
    seq_lens = range(1000, 1000 + block_size)
    exact = ledgers.exact_fragmentation_slots(seq_lens, block_size)
    assert exact == ledgers.expected_fragmentation_slots(block_size, block_size)
    mean_len = sum(seq_lens) / block_size
    expected_entries = ledgers.expected_table_entries(block_size, mean_len, block_size)
    assert ledgers.exact_table_entries(seq_lens, block_size) == pytest.approx(expected_entries)
