"""Trace loaders, token expansion, synthetic workloads and the prefix oracle, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.traces import (
    LengthDist,
    TraceRequest,
    generate,
    ideal_prefix_hit_tokens,
    load_trace,
    parse_spec,
    segment_tokens,
    shared_prefix_tokens,
    shared_trace,
    shared_traces_candidates,
)


def write_mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h})
            + "\n"
            for t, i, o, h in rows
        )
    )
    return path


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_mooncake_hash_ids_become_exactly_shared_token_prefixes(tmp_path: Path) -> None:
    path = write_mooncake(
        tmp_path / "t.jsonl",
        [(0, 1500, 10, [0, 1, 2]), (250, 1400, 5, [0, 1, 3]), (1000, 700, 1, [0, 4])],
    )
    a, b, c = load_trace(path)
    assert [r.arrival_time_s for r in (a, b, c)] == [0.0, 0.25, 1.0]
    assert a.prompt == ((0, 512), (1, 512), (2, 476))
    ta, tb, tc = (segment_tokens(r.prompt) for r in (a, b, c))
    assert (len(ta), len(tb), len(tc)) == (1500, 1400, 700)
    assert common_prefix(ta, tb) == 1024 and common_prefix(ta, tc) == 512
    assert shared_prefix_tokens([a, b, c]) == [0, 1024, 512]
    # Block 16 keeps whole 512-token segments; block 1000 keeps one block of B's 1024.
    assert ideal_prefix_hit_tokens([a, b, c], 16) == 1024 + 512
    assert ideal_prefix_hit_tokens([a, b, c], 1000) == 1000


def test_partial_last_segment_is_shared_up_to_its_length() -> None:
    short = TraceRequest(0.0, ((7, 512), (8, 100)), 1)
    longer = TraceRequest(1.0, ((7, 512), (8, 300), (9, 5)), 1)
    again = TraceRequest(2.0, ((7, 512), (8, 300)), 1)
    assert shared_prefix_tokens([short, longer, again]) == [0, 612, 812]
    # The last prompt token is never a hit: 812 - 1 = 811 -> 800 at B = 16.
    assert ideal_prefix_hit_tokens([short, longer, again], 16) == 608 + 800


def test_mooncake_bad_line_names_its_number(tmp_path: Path) -> None:
    path = write_mooncake(tmp_path / "t.jsonl", [(0, 600, 1, [0, 1])])
    with path.open("a") as f:
        f.write('{"timestamp": 5, "input_length": 600}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: .*output_length"):
        load_trace(path)
    bad = write_mooncake(tmp_path / "b.jsonl", [(0, 600, 1, [0])])
    with pytest.raises(ValueError, match=r"b\.jsonl:1: .*1 hash_ids for 600 input tokens"):
        load_trace(bad)


def test_azure_csv_arrivals_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.5000000,374,44\n"
        "2023-11-16 18:15:48.2500000,1030,0\n"
    )
    a, b = load_trace(path)
    assert (a.arrival_time_s, a.prompt_len_tokens, a.output_len_tokens) == (0.0, 374, 44)
    assert b.arrival_time_s == pytest.approx(1.75) and b.output_len_tokens == 0  # as written
    assert shared_prefix_tokens([a, b]) == [0, 0]  # no prefix information: nothing shared
    (half,) = load_trace(path, max_requests=1, rate_scale=2.0)
    assert half == a
    assert load_trace(path, rate_scale=2.0)[1].arrival_time_s == pytest.approx(0.875)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,1\n")
    with pytest.raises(ValueError, match=r"a\.csv:2: cannot parse"):
        load_trace(path)


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path / "t.txt")
    with pytest.raises(ValueError, match="no trace file"):
        load_trace(tmp_path / "none.jsonl")


def test_synthetic_spec_parsing_and_determinism() -> None:
    spec = parse_spec("requests=5,prompt=100-200,output=7,rate=2,system=600,turns=2,gap=3")
    assert spec.prompt_tokens == LengthDist(100, 200) and spec.output_tokens == LengthDist(7, 7)
    reqs = generate(spec, seed=1)
    assert reqs == generate(spec, seed=1) and reqs != generate(spec, seed=2)
    assert len(reqs) == 10 and all(r.output_len_tokens == 7 for r in reqs)
    # the 600-token system prompt: one fresh segment, reserving ids 4_000_000 and 4_000_001
    assert all(r.prompt[0] == (4_000_000, 600) for r in reqs)
    assert all(r.prompt[1][0] == 4_000_002 or r.prompt[1][0] > 4_000_002 for r in reqs)
    first = min(reqs, key=lambda r: r.arrival_time_s)
    second = next(r for r in reqs if r.prompt[: len(first.prompt)] == first.prompt and r != first)
    # Turn 2 = turn 1's prompt + its 7-token answer + new text, 3 s later.
    assert second.arrival_time_s == pytest.approx(first.arrival_time_s + 3)
    assert second.prompt[len(first.prompt)] == first.output[0] and first.output[0][1] == 7
    for bad in ("requests=0", "prompt=9-3", "color=red", "rate=fast", "prompt", "output=exp:0"):
        with pytest.raises(ValueError, match="synthetic spec|must|>= 1"):
            parse_spec(bad)


def test_real_traces_load_if_present() -> None:
    mooncake = shared_trace("mooncake_conversation.jsonl")
    azure = shared_trace("azure_llm_2023_conv.csv")
    if mooncake is None or azure is None:
        places = ", ".join(map(str, shared_traces_candidates()))
        pytest.skip(f"shared traces not found beside the repository ({places})")
    reqs = load_trace(mooncake, max_requests=100)
    assert len(reqs) == 100 and reqs[0].arrival_time_s == 0.0
    assert reqs[0].prompt_len_tokens == 6758 and reqs[0].output_len_tokens == 500
    assert len(load_trace(azure, max_requests=50)) == 50


def test_exponential_lengths_have_the_mean_and_respect_the_cap() -> None:
    spec = parse_spec("requests=4000,prompt=exp:600:2000,output=1")
    lengths = [r.prompt_len_tokens for r in generate(spec, seed=5)]
    assert max(lengths) == 2000 and min(lengths) >= 1
    # exp(mean 600) clipped at 2000 has mean 600 * (1 - e^(-2000/600)) ~ 578
    assert abs(sum(lengths) / len(lengths) - 578) < 25


def test_a_bad_line_can_be_skipped_and_reported(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}'
    trace.write_text(
        good + "\nnot json\n" + good.replace('"timestamp": 0', '"timestamp": 5') + "\n"
    )
    with pytest.raises(ValueError, match=r"t\.jsonl:2:"):
        load_trace(trace)
    bad: list[ValueError] = []
    requests = load_trace(trace, on_bad_line=bad.append)
    assert len(requests) == 2 and [str(e).split(": ")[0] for e in bad] == [f"{trace}:2"]


def test_simulate_cli_skips_a_bad_line_with_a_warning_unless_strict(tmp_path: Path, capsys) -> None:
    from pagedkv.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,100,10\nbad,line\n2023-11-16 18:17:04.0,200,5\n"
    )
    args = [
        "simulate",
        "--trace",
        str(trace),
        "--model",
        "llama-3-8b",
        "--policy",
        "vllm",
        "--json",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "skipped 1 unparsable line" in captured.err and "t.csv:3" in captured.err
    assert '"num_requests": 2' in captured.out
    assert main([*args, "--strict"]) == 2
    assert "t.csv:3: cannot parse" in capsys.readouterr().err
