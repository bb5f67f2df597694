"""`pagedkv plan --prefix-match-unit`: the third ledger counted in units of U (hand-computed),
the copy per hit beside it, the recommendation it moves, and bad units as one error line."""

from __future__ import annotations

import pytest

from pagedkv.planner import ledgers
from tests.planner.helpers import plan_json, rows_by_block_size, run_plan

C = 4096  # KV bytes per token
BASE = ("--record-bytes", str(C), "--num-seqs", "100", "--mean-len", "1000", "--max-len", "4000")


def test_prefix_copy_tokens_by_hand():
    # P = 300: 300 mod 64 = 44 tokens into its last block; U = 8 keeps 40 of them (44 - 4).
    assert ledgers.prefix_copy_tokens(300, 64, 8) == 40
    assert ledgers.prefix_copy_tokens(300, 64, 1) == 44
    assert ledgers.prefix_copy_tokens(300, 64, 64) == 0
    assert ledgers.mean_prefix_copy_tokens([300, 256], 64, 1) == 22.0
    with pytest.raises(ValueError, match="must divide"):
        ledgers.prefix_copy_tokens(300, 64, 3)


def test_the_lost_prefix_flattens_and_the_recommendation_moves():
    """P = 300 for all 100 sequences. Whole blocks lose P mod B: 300 mod 128 = 44 tokens a hit,
    44 * 4096 * 100 = 18.02 MB at B = 128; with U = 4 every B loses 300 mod 4 = 0."""
    args = (*BASE, "--prefix-len", "300", "--block-sizes", "16,64,128")
    whole = rows_by_block_size(plan_json(*args))
    partial_report = plan_json(*args, "--prefix-match-unit", "4")
    partial = rows_by_block_size(partial_report)
    assert whole[128]["prefix_lost_tokens"] == 44 and whole[16]["prefix_lost_tokens"] == 12
    assert whole[128]["prefix_waste_bytes"] == 44 * C * 100
    for b in (16, 64, 128):
        assert partial[b]["prefix_lost_tokens"] == 0 and partial[b]["prefix_waste_bytes"] == 0
        assert partial[b]["prefix_match_unit"] == 4
        assert partial[b]["prefix_copy_tokens"] == 300 % b  # all of the partial block
        assert partial[b]["prefix_copy_bytes"] == (300 % b) * C
        # W(B) loses exactly the lost-prefix bytes it had.
        assert partial[b]["total_bytes"] == whole[b]["total_bytes"] - whole[b]["prefix_waste_bytes"]
    assert partial_report["prefix_match_unit"] == 4
    reasons = " ".join(partial_report["recommendation"]["reasons"])
    assert "partial-block reuse (U=4)" in reasons


def test_a_unit_above_a_candidate_matches_its_whole_blocks():
    rows = rows_by_block_size(
        plan_json(
            *BASE, "--prefix-len", "300", "--block-sizes", "8,64", "--prefix-match-unit", "16"
        )
    )
    assert rows[8]["prefix_match_unit"] is None and rows[8]["prefix_lost_tokens"] == 300 % 8
    assert rows[64]["prefix_match_unit"] == 16 and rows[64]["prefix_lost_tokens"] == 300 % 16


BAD_UNITS = [
    ("3", "--prefix-match-unit: 3 must divide every candidate block size above it, not B=16"),
    ("0", "--prefix-match-unit must be >= 1 token"),
    ("x", "--prefix-match-unit: expected a whole number written with digits 0-9, got 'x'"),
]


@pytest.mark.parametrize(("unit", "message"), BAD_UNITS)
def test_bad_units_are_one_error_line(unit, message):
    code, out, err = run_plan(*BASE, "--block-sizes", "16", "--prefix-match-unit", unit)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"pagedkv plan: error: {message}"]
