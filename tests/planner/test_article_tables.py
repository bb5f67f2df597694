"""Acceptance: every numeric table of the first article, and the second article's 14 vs 77.

The expected numbers below are hand-transcribed from seeds/000_3955479f07e5fe92.txt and
seeds/002_f0164fe4c0762047.txt (the independent reference); the observed numbers come from
the JSON that `pagedkv plan --json` prints. The article's MB is 10^6 bytes; its block-table
"KB" column is KiB (4 * 128 * 1024 B = 512 "KB").
"""

from __future__ import annotations

import pytest

from tests.planner.helpers import ARTICLE_RECORD_BYTES, plan_json, rows_by_block_size

C = str(ARTICLE_RECORD_BYTES)
ALL_B = "1,8,16,32,64,128"

# Table "第二本账" 1: K=128, mean length 2048, c=4096. B -> (slots wasted per sequence, MB)
FRAGMENTATION_K128 = {
    1: (0, 0),
    8: (3.5, 1.84),
    16: (7.5, 3.93),
    32: (15.5, 8.13),
    64: (31.5, 16.52),
    128: (63.5, 33.29),
}
# Table "第二本账" 2: K=256, mean length 64.
FRAGMENTATION_K256 = {
    1: (0, 0),
    8: (3.5, 3.67),
    16: (7.5, 7.86),
    32: (15.5, 16.25),
    64: (31.5, 33.03),
    128: (63.5, 66.58),
}


@pytest.mark.parametrize(
    ("num_seqs", "mean_len", "expected"),
    [("128", "2048", FRAGMENTATION_K128), ("256", "64", FRAGMENTATION_K256)],
)
def test_internal_fragmentation_tables(num_seqs, mean_len, expected):
    report = plan_json(
        "--record-bytes", C, "--num-seqs", num_seqs, "--mean-len", mean_len, "--block-sizes", ALL_B
    )
    rows = rows_by_block_size(report)
    assert set(rows) == set(expected)
    for block_size, (per_seq_slots, total_mb) in expected.items():
        row = rows[block_size]
        assert row["internal_fragmentation_slots_per_seq"] == per_seq_slots
        assert row["internal_fragmentation_mb"] == total_mb


# Table "第三本账" 1: P = 1200. B -> (reusable tokens, wasted tokens, reuse rate %)
PREFIX_1200 = {
    16: (1200, 0, 100.0),
    32: (1184, 16, 98.7),
    64: (1152, 48, 96.0),
    128: (1152, 48, 96.0),
}
# Table "第三本账" 2: P uniform in [64, 256] (integers, both ends), mean of per-request ratios.
PREFIX_RANGE_64_256 = {1: 100.0, 8: 97.5, 16: 94.7, 32: 89.3, 64: 79.3, 128: 46.6}


def test_prefix_reuse_for_a_1200_token_system_prompt():
    report = plan_json(
        "--record-bytes", C, "--num-seqs", "1", "--max-len", "2048",
        "--prefix-len", "1200", "--block-sizes", "16,32,64,128",
    )  # fmt: skip
    rows = rows_by_block_size(report)
    for block_size, (reused, wasted, rate_pct) in PREFIX_1200.items():
        assert rows[block_size]["prefix_reuse_tokens"] == reused
        assert rows[block_size]["prefix_lost_tokens"] == wasted
        assert round(100 * rows[block_size]["prefix_reuse_rate"], 1) == rate_pct


def test_mean_prefix_reuse_for_a_uniform_prefix_distribution():
    report = plan_json(
        "--record-bytes", C, "--num-seqs", "1", "--max-len", "512",
        "--prefix-range", "64:256", "--block-sizes", ALL_B,
    )  # fmt: skip
    rows = rows_by_block_size(report)
    assert report["workload"]["prefix_len_tokens"]["count"] == 256 - 64 + 1
    for block_size, rate_pct in PREFIX_RANGE_64_256.items():
        assert round(100 * rows[block_size]["prefix_reuse_rate"], 1) == rate_pct


# Table "第四本账": block bytes for c = 4096 (KiB).
BLOCK_KIB = {1: 4, 8: 32, 16: 64, 32: 128, 64: 256, 128: 512}


def test_block_bytes_from_record_bytes_and_from_the_articles_model(tmp_path):
    explicit = rows_by_block_size(
        plan_json(
            "--record-bytes", C, "--num-seqs", "1", "--max-len", "128", "--block-sizes", ALL_B
        )
    )
    # The same record built from shapes: one layer, 8 KV heads x 128 dims, FP16.
    config = tmp_path / "config.json"
    config.write_text(
        '{"num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,'
        ' "hidden_size": 4096, "torch_dtype": "float16"}'
    )
    report = plan_json(
        "--model", str(config), "--num-seqs", "1", "--max-len", "128", "--block-sizes", ALL_B
    )
    assert report["model"]["record_bytes"] == ARTICLE_RECORD_BYTES
    from_shapes = rows_by_block_size(report)
    for block_size, kib in BLOCK_KIB.items():
        assert explicit[block_size]["block_kib"] == kib
        assert from_shapes[block_size]["block_bytes"] == kib * 1024


# The two W(B) tables of "一张估算表". B -> (fragmentation MB, table "KB", prefix MB, total MB)
WASTE_TABLE_1 = {  # K=128, L_max=8192, c=4096, P=1200, H=128
    8: (1.84, 512, 0, 2.35),
    16: (3.93, 256, 0, 4.18),
    32: (8.13, 128, 8.39, 16.64),
    64: (16.52, 64, 25.17, 41.74),
    128: (33.29, 32, 25.17, 58.49),
}
# The article's P=4096 is longer than its own L_max=256, which the planner refuses (a shared
# prefix is part of the sequence it prefixes). Any P that every candidate B divides gives the
# article's rows exactly (P mod B = 0: no prefix waste), so the table is priced at P = 256.
WASTE_TABLE_2 = {  # K=256, L=64, L_max=256, P=4096 (article) -> 256 here, H=256
    8: (3.67, 32, 0, 3.7),
    16: (7.86, 16, 0, 7.88),
    32: (16.25, 8, 0, 16.26),
    64: (33.03, 4, 0, 33.03),
    128: (66.58, 2, 0, 66.59),
}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("128", "2048", "8192", "1200", "128"), WASTE_TABLE_1),
        (("256", "64", "256", "256", "256"), WASTE_TABLE_2),
    ],
)
def test_waste_tables(args, expected):
    num_seqs, mean_len, max_len, prefix_len, hits = args
    report = plan_json(
        "--record-bytes", C, "--num-seqs", num_seqs, "--mean-len", mean_len,
        "--max-len", max_len, "--prefix-len", prefix_len, "--prefix-hits", hits,
        "--block-sizes", "8,16,32,64,128",
    )  # fmt: skip
    rows = rows_by_block_size(report)
    for block_size, (frag_mb, table_kib, prefix_mb, total_mb) in expected.items():
        row = rows[block_size]
        assert row["internal_fragmentation_mb"] == frag_mb
        assert row["table_kib"] == table_kib
        assert row["prefix_waste_mb"] == prefix_mb
        # The article adds its KiB column as thousandths of an MB: agree within 0.01 MB.
        assert row["total_mb"] == pytest.approx(total_mb, abs=0.0100001)
        assert row["total_bytes"] == (
            row["internal_fragmentation_bytes"] + row["table_bytes"] + row["prefix_waste_bytes"]
        )
    # Both tables' lesson: the smallest block wastes least here.
    assert report["recommendation"]["block_size"] == 8


def test_prefix_3000_loses_56_tokens_per_hit_at_128():
    # The article's aside: P = 3000 at B = 128 reuses 2944 and loses 3000 - 2944 = 56 per hit.
    row = rows_by_block_size(
        plan_json(
            "--record-bytes",
            C,
            "--num-seqs",
            "256",
            "--max-len",
            "4096",
            "--prefix-len",
            "3000",
            "--block-sizes",
            "128",
        )  # fmt: skip
    )[128]
    assert (row["prefix_reuse_tokens"], row["prefix_lost_tokens"]) == (2944, 56)
    assert row["prefix_waste_bytes"] == 56 * 256 * ARTICLE_RECORD_BYTES


def test_swap_transfer_counts_for_one_gib():
    # "回收 1 GiB KV ... B=128 需要 2048 次传输; B=16 16384 次; B=8 32768 次" at 4 KiB per token.
    rows = rows_by_block_size(
        plan_json(
            "--record-bytes",
            C,
            "--num-seqs",
            "1",
            "--max-len",
            "128",
            "--block-sizes",
            "8,16,128",
            "--swap-bytes",
            "1GiB",
        )  # fmt: skip
    )
    assert {b: r["swap_transfers"] for b, r in rows.items()} == {8: 32768, 16: 16384, 128: 2048}


CAPACITY_ARGS = ("--model", "llama-3-8b", "--kv-dtype", "fp16", "--num-seqs", "1",
                 "--mean-len", "6k", "--max-len", "32k", "--block-sizes", "16")  # fmt: skip


def test_second_article_card_14_reserved_vs_77_paged():
    # 80G card, 8B FP16: KV pool 58G; reserving 32k costs 4G per request, 6k actual 0.75G.
    report = plan_json(*CAPACITY_ARGS, "--memory", "58GiB")
    assert report["model"]["record_bytes"] * 32 * 1024 == 4 * 2**30
    assert report["model"]["record_bytes"] * 6 * 1024 == 0.75 * 2**30
    assert report["capacity"]["reserved_capacity_seqs"] == 14
    assert rows_by_block_size(report)[16]["paged_capacity_seqs"] == 77


def test_second_article_budget_from_the_card():
    # Weights 16G + activations 4G + KV pool 58G on 80G: the remaining 2G is other overhead.
    report = plan_json(
        *CAPACITY_ARGS, "--gpu-memory", "80GiB", "--weights", "16GiB",
        "--activations", "4GiB", "--overhead", "2GiB",
    )  # fmt: skip
    assert report["capacity"]["pool_bytes"] == 58 * 2**30
    assert report["capacity"]["reserved_capacity_seqs"] == 14
    assert rows_by_block_size(report)[16]["paged_capacity_seqs"] == 77


# Second article: share of a 32k reservation left unused at each actual length.
RESERVED_WASTE_PCT = {"2k": 94, "6k": 81, "16k": 50, "30k": 6}


@pytest.mark.parametrize(("mean_len", "waste_pct"), RESERVED_WASTE_PCT.items())
def test_second_article_reservation_waste(mean_len, waste_pct):
    args = list(CAPACITY_ARGS)
    args[args.index("6k")] = mean_len
    report = plan_json(*args, "--memory", "58GiB")
    assert round(100 * report["capacity"]["reserved_waste_rate"]) == waste_pct
