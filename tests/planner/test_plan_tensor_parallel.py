"""``plan --tensor-parallel-size``: the ledgers of one rank's pages, against hand-computed bytes
(Llama-3-8B in bf16: 32 layers x K,V x 8 KV heads x 128 x 2 bytes = 131072 B/token whole)."""

from __future__ import annotations

import json

from pagedkv.cli import main

ARGS = "plan --model llama-3-8b --num-seqs 8 --mean-len 1000 --max-len 2000 --block-sizes 16 --json"
ARGS = ARGS.split()


def _plan(capsys, *extra: str) -> dict:
    assert main([*ARGS, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_ranks_page_holds_its_kv_heads(capsys):
    whole = _plan(capsys)
    assert whole["model"]["record_bytes"] == 131072 and whole["tensor_parallel_size"] == 1
    two = _plan(capsys, "--tensor-parallel-size", "2")  # 4 KV heads a rank
    assert two["model"]["record_bytes"] == 65536
    assert two["rows"][0]["block_bytes"] == 16 * 65536
    assert two["tensor_parallel_size"] == 2
    sixteen = _plan(capsys, "--tp", "16")  # 8 KV heads over 16 ranks: one each, on two ranks
    assert sixteen["model"]["record_bytes"] == 131072 // 8


def test_a_size_the_heads_refuse_is_one_error_line(capsys):
    assert main([*ARGS, "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "pagedkv plan: error: --tensor-parallel-size 3 does not divide the model's 32 query "
        "heads (sizes that do: 1, 2, 4, 8, 16, 32)"
    ]
