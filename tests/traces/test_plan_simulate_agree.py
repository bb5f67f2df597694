"""`plan --trace` and `simulate --trace` read one file the same way: same prefix lengths."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from pagedkv.cli import main

# (timestamp ms, input tokens, hash_ids): requests 100 s apart, so each one finishes (and its
# blocks are cached) before the next arrives.
RECORDS = [
    (0, 700, [5, 6]),
    (100_000, 1000, [5, 6]),  # the earlier request held 700 of these tokens: reuses 700
    (200_000, 1000, [5, 6]),  # the whole prompt was seen: reuses all but the last token, 999
    (300_000, 300, [5]),  # inside block 5: 300 shared, 299 reusable
    (400_000, 1500, [9, 10, 11]),  # nothing shared
]
REUSABLE = [700, 999, 299]  # by hand, from the comments above


def _run(*args: str) -> object:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def test_plan_and_simulate_agree_on_the_prefix_lengths_of_one_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": 4, "hash_ids": ids})
            + "\n"
            for t, n, ids in RECORDS
        )
    )
    plan = _run("plan", "--trace", str(path), "--record-bytes", "8", "--num-seqs", "5",
                "--block-sizes", "1,16", "--json")  # fmt: skip
    prefixes = plan["workload"]["prefix_len_tokens"]
    assert prefixes["count"] == 3 and prefixes["total"] == sum(REUSABLE)
    assert (prefixes["min"], prefixes["max"]) == (min(REUSABLE), max(REUSABLE))
    rows = {r["block_size"]: r for r in plan["rows"]}

    runs = _run("simulate", "--trace", str(path), "--policy", "vllm", "--block-sizes", "1,16",
                "--max-model-len", "4k", "--kv-memory", "2GiB", "--json")  # fmt: skip
    by_block = {r["block_size"]: r for r in runs}
    for block_size in (1, 16):
        whole_blocks = sum(p - p % block_size for p in REUSABLE)
        # plan's mean reuse per hit x hits == simulate's ideal == what the real allocator hit
        assert rows[block_size]["prefix_reuse_tokens"] * prefixes["count"] == whole_blocks
        assert by_block[block_size]["ideal_prefix_hit_tokens"] == whole_blocks
        assert by_block[block_size]["prefix_hit_tokens"] == whole_blocks
