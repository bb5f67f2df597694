"""Detokenising cost per output token: the engine's Detokenizer vs the first version's tracker.

For outputs of 256, 2,048 and 8,192 tokens (the embedded SmolLM2 tokenizer, a text with
English, code, digits and multi-byte characters, two stop strings that never match but keep the
hold-back busy), each side is fed the same tokens one by one. One measurement decodes 8,192
tokens in all (32 outputs of 256, 4 of 2,048, 1 of 8,192: short runs are not left to timer and
scheduler noise) with the garbage collector paused. Time is this process's CPU time
(``time.process_time``): on a machine shared with other jobs, wall time measured their load,
not ours. The figure is microseconds per token, the median of the repeats (the sides alternate
inside each repeat). The baseline is the first version's algorithm,
kept here only as the thing to measure against: re-decode the whole output after every token.

"Flat" means the per-token cost does not grow with the output: ratio 8,192 / 256 <= 1.5.
Writes results/bench_detok.json and prints a markdown table.

    python benchmarks/bench_detok.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from common import alternate, finish_meta, gc_paused, machine_meta, seconds, write_json
from pagedkv.engine.detokenizer import Detokenizer
from pagedkv.model.embedded import embedded_model_path
from pagedkv.model.gguf import gguf_metadata, read_gguf
from pagedkv.model.tokenizer import Tokenizer, tokenizer_from_gguf_metadata

LENGTHS_TOKENS = (256, 2048, 8192)
TOTAL_TOKENS = 8192  # tokens decoded per measurement, whatever the output length
STOPS = ("</answer>", "\n\nUser:")
PARAGRAPH = (
    "A paged KV cache stores keys and values in fixed-size blocks; a block table maps each "
    "sequence's logical blocks to physical ones. Über-long contexts (日本語のテキスト, 🙂) "
    "cost 2,048 or 8,192 tokens.\n    def slot(block_id, offset):\n        return block_id * "
    "16 + offset  # one slot per token\n\n"
)


def old_tracker_run(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The first version's TextTracker.update, inlined: decode everything after every token."""
    text, seen = "", []
    for token_id in ids:
        seen.append(token_id)
        full = tokenizer.decode(seen)
        if full.endswith("\ufffd"):
            continue
        start = len(text)
        hits = [full.find(s, max(0, start - len(s) + 1)) for s in STOPS]
        hits = [at for at in hits if at != -1]
        text = full[: min(hits)] if hits else full
        if hits:
            break
    return text


def new_detokenizer_run(tokenizer: Tokenizer, ids: list[int]) -> str:
    detok = Detokenizer(tokenizer, STOPS)
    for token_id in ids:
        detok.push(token_id)
    detok.flush()
    return detok.text


def per_token_us(run, tokenizer: Tokenizer, ids: list[int]) -> tuple[float, str]:
    """Microseconds per token over ``TOTAL_TOKENS`` tokens (whole outputs of ``ids``)."""
    num_runs = max(1, TOTAL_TOKENS // len(ids))
    last = [""]

    def runs() -> None:
        for _ in range(num_runs):
            last[0] = run(tokenizer, ids)

    with gc_paused():
        elapsed_s = seconds(runs, clock=time.process_time)
    return elapsed_s / (num_runs * len(ids)) * 1e6, last[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/bench_detok.json")
    args = parser.parse_args()
    meta = machine_meta()
    tokenizer = tokenizer_from_gguf_metadata(gguf_metadata(read_gguf(embedded_model_path())))
    para_ids = tokenizer.encode(PARAGRAPH, add_special_tokens=False)
    stream = para_ids * (max(LENGTHS_TOKENS) // len(para_ids) + 1)
    rows = []
    for n in LENGTHS_TOKENS:
        ids = stream[:n]
        runs = alternate(
            {
                "old": lambda ids=ids: per_token_us(old_tracker_run, tokenizer, ids),
                "new": lambda ids=ids: per_token_us(new_detokenizer_run, tokenizer, ids),
            },
            args.repeats,
        )
        old_us, new_us = [us for us, _ in runs["old"]], [us for us, _ in runs["new"]]
        for (_, old_text), (_, new_text) in zip(runs["old"], runs["new"], strict=True):
            # Same tokens, same text: the old side never held text back, so after a flush the
            # two agree exactly (up to an incomplete character at the very end).
            assert new_text == old_text.rstrip("\ufffd"), (n, new_text[-40:], old_text[-40:])
        rows.append(
            {
                "output_tokens": n,
                "old_us_per_token": statistics.median(old_us),
                "new_us_per_token": statistics.median(new_us),
                "old_runs_us": old_us,
                "new_runs_us": new_us,
            }
        )
    base = rows[0]
    result = {
        "benchmark": "detokenising cost per output token",
        "tokenizer": "embedded SmolLM2-135M-Instruct (GGUF), byte-level BPE",
        "stops": list(STOPS),
        "repeats": args.repeats,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
        "new_ratio_longest_to_shortest": rows[-1]["new_us_per_token"] / base["new_us_per_token"],
        "old_ratio_longest_to_shortest": rows[-1]["old_us_per_token"] / base["old_us_per_token"],
        "meta": finish_meta(meta),
    }
    write_json(args.out, result)

    print(
        "| output tokens | old µs/token (full re-decode) | new µs/token (Detokenizer) | speed-up |"
    )
    print("|---:|---:|---:|---:|")
    for r in rows:
        speedup = r["old_us_per_token"] / r["new_us_per_token"]
        print(
            f"| {r['output_tokens']:,} | {r['old_us_per_token']:.1f} | "
            f"{r['new_us_per_token']:.2f} | {speedup:.0f}x |"
        )
    print(
        f"\nratio {LENGTHS_TOKENS[-1]:,} / {LENGTHS_TOKENS[0]}: new "
        f"{result['new_ratio_longest_to_shortest']:.2f} (flat means <= 1.5), old "
        f"{result['old_ratio_longest_to_shortest']:.1f}"
    )


if __name__ == "__main__":
    main()
