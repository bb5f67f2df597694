"""Workloads from parameters and from trace files (small hand-made ones, then the real traces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.planner.workload import TraceStats, Workload
from pagedkv.traces import load_trace as read_trace
from pagedkv.traces import shared_traces_dir
from tests.planner.helpers import plan_json, rows_by_block_size, run_plan


def load_trace(path: Path) -> TraceStats:
    return TraceStats.from_requests(str(path), read_trace(path))


TRACES = shared_traces_dir()


def test_parameters_default_one_length_to_the_other():
    assert Workload.from_parameters(4, mean_len_tokens=100).max_len_tokens == 100
    assert Workload.from_parameters(4, max_len_tokens=100).mean_len_tokens == 100
    with pytest.raises(ValueError, match="--mean-len"):
        Workload.from_parameters(4)
    with pytest.raises(ValueError, match="mean_len must be in"):
        Workload.from_parameters(4, mean_len_tokens=200, max_len_tokens=100)
    with pytest.raises(ValueError, match="num_seqs"):
        Workload.from_parameters(0, mean_len_tokens=10)


def _azure(tmp_path: Path) -> Path:
    path = tmp_path / "azure.csv"
    # final lengths 1, 16, 17, 100 (context + generated)
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.68,1,0\n2023-11-16 18:15:47.00,10,6\n"
        "2023-11-16 18:15:48.00,16,1\n2023-11-16 18:15:49.00,90,10\n"
    )
    return path


def test_azure_trace_gives_exact_ledgers_scaled_to_k(tmp_path):
    stats = load_trace(_azure(tmp_path))
    assert stats.seq_lens_tokens == (1, 16, 17, 100)
    assert stats.prefix_lens_tokens == (0, 0, 0, 0)
    report = plan_json("--record-bytes", "10", "--trace", str(_azure(tmp_path)),
                       "--num-seqs", "8", "--block-sizes", "16")  # fmt: skip
    row = rows_by_block_size(report)[16]
    # at B=16 the four lengths use 11 blocks and leave 42 slots empty; K=8 is twice the sample
    assert row["table_entries"] == 22
    assert row["internal_fragmentation_slots"] == 84
    assert row["internal_fragmentation_bytes"] == 840
    assert row["table_bytes"] == 4 * 8 * 7  # padded to ceil(100/16) = 7 columns
    assert report["workload"]["max_len_tokens"] == 100
    assert report["workload"]["num_prefix_hits"] == 0


def _mooncake(tmp_path: Path) -> Path:
    records = [
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 2, "input_length": 300, "output_length": 1, "hash_ids": [0]},
        {"timestamp": 3, "input_length": 600, "output_length": 0, "hash_ids": [7, 1]},
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_mooncake_prefixes_are_leading_blocks_seen_before(tmp_path):
    stats = load_trace(_mooncake(tmp_path))
    assert stats.seq_lens_tokens == (1010, 1205, 301, 600)
    # first request: nothing seen. Second: block 0 (512) and block 1, which the first request
    # held only 1000 - 512 = 488 tokens of: 1000, not 1024. Third: block 0 covers its whole
    # 300-token input, and the last prompt token is always computed: 299. Fourth: starts with
    # an unseen block, so no prefix at all.
    assert stats.prefix_lens_tokens == (0, 1000, 299, 0)
    workload = stats.to_workload(num_seqs=8)
    assert workload.prefix_lens_tokens == (1000, 299)
    assert workload.num_prefix_hits == 4  # half the sample hits, K = 8
    assert stats.to_workload(num_seqs=8, num_prefix_hits=1).num_prefix_hits == 1


def test_a_longer_request_reuses_only_what_the_earlier_one_held(tmp_path):
    # The case: 700 tokens, then 1,000 with the same hash_ids. plan said 1,000.
    path = tmp_path / "t.jsonl"
    rows = [(0, 700), (1000, 1000)]
    path.write_text("".join(
        json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": [5, 6]})
        + "\n" for t, n in rows
    ))  # fmt: skip
    assert load_trace(path).prefix_lens_tokens == (0, 700)


def test_unreadable_traces_are_one_line_naming_the_file(tmp_path):
    code, _, err = run_plan("--record-bytes", "8", "--num-seqs", "1", "--trace",
                            str(tmp_path / "none.csv"))  # fmt: skip
    assert code == 2 and "no trace file" in err and "none.csv" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    code, _, err = run_plan("--record-bytes", "8", "--num-seqs", "1", "--trace", str(bad))
    assert code == 2 and err.count("\n") == 1
    assert f"{bad}:1: expected the columns TIMESTAMP,ContextTokens,GeneratedTokens" in err
    code, _, err = run_plan("--record-bytes", "8", "--num-seqs", "1", "--trace", str(tmp_path))
    assert code == 2 and "is a directory" in err


@pytest.mark.skipif(TRACES is None, reason="shared traces not present")
def test_real_traces_plan_end_to_end():
    assert TRACES is not None
    conv = plan_json("--model", "llama-3-8b", "--trace", str(TRACES / "azure_llm_2023_conv.csv"),
                     "--num-seqs", "64")  # fmt: skip
    assert conv["workload"]["num_prefix_hits"] == 0
    assert conv["recommendation"]["block_size"] in (1, 8, 16, 32, 64, 128)
    moon = plan_json("--model", "llama-3-8b",
                     "--trace", str(TRACES / "mooncake_conversation.jsonl"), "--num-seqs", "64")  # fmt: skip
    prefixes = moon["workload"]["prefix_len_tokens"]
    assert moon["workload"]["num_prefix_hits"] > 0
    assert prefixes["min"] > 0
    rows = rows_by_block_size(moon)
    # Mooncake prefixes are whole 512-token blocks unless capped by a request's input length,
    # so block sizes dividing 512 lose almost nothing.
    assert rows[128]["prefix_reuse_rate"] > 0.95
