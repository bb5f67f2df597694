"""Bad trace records: each is skipped with a FILE:LINE message (or raised), never a traceback,
and a record that contradicts itself is one of them. Records are written by hand here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.errors import UsageError
from pagedkv.traces import load_trace, parse_spec

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}


def _mooncake(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _line(**changes) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (_line(timestamp="12"), "timestamp must be a finite number"),
        (b'{"timestamp": NaN, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}',
         "timestamp must be a finite number"),
        (_line(input_length=10.5, hash_ids=[0]), "input_length must be a whole number"),
        (_line(hash_ids=[0, 1.5]), "hash ids must be integers"),
        (_line(hash_ids=[0, True]), "hash ids must be integers"),
        (b'{"timestamp": 0, "input_length": 600, "output_length": 1e400, "hash_ids": [0, 1]}',
         "output_length must be a whole number"),
        (_line(input_length=700, hash_ids=[0, 1, 2]), "3 hash_ids for 700 input tokens"),
        (_line(input_length=-5, hash_ids=[]), "input_length must be in [1, "),
        (_line(output_length=10**400), "output_length must be in [0, 1099511627776]"),
        (b'[1, 2]', "expected a JSON object"),
        (b'{"timestamp": 0, "input_length": 6\xff00}', "not valid UTF-8"),
    ],
)  # fmt: skip
def test_a_bad_mooncake_record_is_skipped_naming_file_and_line(tmp_path, bad_line, message):
    path = _mooncake(tmp_path / "t.jsonl", [_line(), bad_line, _line(timestamp=2000)])
    skipped: list[UsageError] = []
    requests = load_trace(path, on_bad_line=skipped.append)
    assert [r.arrival_time_s for r in requests] == [0.0, 2.0]  # both good records replay
    (error,) = skipped
    assert str(error).startswith(f"{path}:2: ") and message in str(error)
    with pytest.raises(UsageError, match=f"{path.name}:2: "):  # the default: raise
        load_trace(path)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2023-11-16 18:15:47.0000000,-50,10", "ContextTokens must be in [1, "),
        ("2023-11-16 18:15:47.0000000,10.5,10", "ContextTokens must be a whole number"),
        ("2023-11-16 18:15:47.0000000,10,nan", "GeneratedTokens must be a whole number"),
        ("yesterday,10,10", "cannot parse"),
        ("2023-11-16 18:15:47.0000000,10", "expected 3 columns"),
    ],
)
def test_a_bad_azure_row_is_skipped_naming_file_and_line(tmp_path, row, message):
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        f"2023-11-16 18:15:46.0000000,100,1\n{row}\n2023-11-16 18:15:48.0000000,200,2\n"
    )
    skipped: list[UsageError] = []
    assert [r.prompt_len_tokens for r in load_trace(path, on_bad_line=skipped.append)] == [100, 200]
    assert len(skipped) == 1 and str(skipped[0]).startswith(f"{path}:3: ")
    assert message in str(skipped[0])


def test_invalid_utf8_in_a_csv_costs_only_its_line(tmp_path):
    path = tmp_path / "a.csv"
    path.write_bytes(
        b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,100,1\n"
        b"2023-11-16 18:15:47.0,\xff\xfe,1\n2023-11-16 18:15:48.0,200,2\n"
    )
    skipped: list[UsageError] = []
    assert len(load_trace(path, on_bad_line=skipped.append)) == 2
    assert [str(e) for e in skipped] == [f"{path}:3: the line is not valid UTF-8"]


def test_wrong_columns_a_directory_and_a_bad_rate_are_one_clear_error(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("time,prompt,output\n1,2,3\n")
    with pytest.raises(UsageError, match=r"a\.csv:1: expected the columns TIMESTAMP,Context"):
        load_trace(path)
    with pytest.raises(UsageError, match="is a directory, not a trace file"):
        load_trace(tmp_path)
    good = _mooncake(tmp_path / "t.jsonl", [_line()])
    for rate in (float("nan"), float("inf"), 0.0):
        with pytest.raises(UsageError, match="rate_scale must be a finite number > 0"):
            load_trace(good, rate_scale=rate)


def test_a_two_billion_token_prompt_costs_nothing_to_read(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0,2000000000,10\n2023-11-16 18:15:47.0,100,1\n"
    )
    big, small = load_trace(path)
    assert big.prompt_len_tokens == 2_000_000_000 and len(big.prompt) == 1  # one segment
    # the next fresh segment starts past the big one's first 4,096 x 512 token ids (its
    # reservation is capped: a tail beyond them cannot fake a hit, the starts differ)
    assert small.prompt[0][0] == big.prompt[0][0] + 4096


@pytest.mark.parametrize(
    "spec", ["requests=2,turns=2,gap=nan", "requests=2,rate=nan", "requests=2,gap=inf",
             "requests=2,rate=-inf", "requests=100000,turns=1000"],
)  # fmt: skip
def test_synthetic_spec_refuses_non_finite_numbers_and_giant_workloads(spec):
    with pytest.raises(UsageError, match="synthetic spec"):
        parse_spec(spec)
    assert parse_spec("requests=2,rate=inf").rate_per_s == float("inf")  # the documented one


def test_traces_sit_at_the_bottom_of_the_import_graph():
    """pagedkv.traces imports no other pagedkv package (only pagedkv.errors and the unit rules
    of pagedkv.units, its peers at the bottom), and no torch."""
    code = (
        "import sys, pagedkv.traces\n"
        "mods = sorted(m for m in sys.modules if m.startswith('pagedkv.'))\n"
        "ok = ('pagedkv.traces', 'pagedkv.errors', 'pagedkv.units')\n"
        "bad = [m for m in mods if not m.startswith(ok)]\n"
        "assert not bad and 'torch' not in sys.modules, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_two_giant_prompts_do_not_use_up_the_token_ids_of_the_rest(tmp_path):
    """Two 1.5e9-token prompts are refused; the small request after them still replays."""
    from pagedkv.traces import load_trace
    from pagedkv.traces.segments import segment_tokens

    path = tmp_path / "giants.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:46.{i}000000,{n},10" for i, n in enumerate([1_500_000_000] * 2)]
    rows.append("2023-11-16 18:15:47.0000000,100,10")
    path.write_text("\n".join(rows) + "\n")
    requests = load_trace(path)
    small = requests[-1]
    ids = segment_tokens(small.prompt)
    assert len(ids) == 100 and len(set(ids)) == 100
    giant_starts = {segment_tokens(((r.prompt[0][0], 1),))[0] for r in requests[:2]}
    assert ids[0] not in giant_starts  # every fresh segment begins with a token of its own


@pytest.mark.parametrize(
    "spec",
    [
        "requests=50,turns=3,gap=2,rate=1",
        "requests=50,turns=4,gap=30,rate=5",
        "requests=40,turns=2,gap=5,rate=inf",
        "requests=30,rate=inf",
    ],
)
@pytest.mark.parametrize("max_requests", [1, 7, 60, 500])
def test_max_requests_takes_the_first_requests_of_the_whole_workload(spec, max_requests):
    from pagedkv.traces.synthetic import generate, parse_spec

    whole = generate(parse_spec(spec), seed=3)
    assert generate(parse_spec(spec), seed=3, max_requests=max_requests) == whole[:max_requests]


def test_a_huge_synthetic_workload_cut_by_max_requests_builds_only_what_it_needs(monkeypatch):
    from pagedkv.traces import synthetic

    built = []
    real = synthetic.TraceRequest
    monkeypatch.setattr(synthetic, "TraceRequest", lambda *a: built.append(1) or real(*a))
    spec = synthetic.parse_spec("requests=10000000,prompt=10-20,output=1-2")
    assert len(synthetic.generate(spec, max_requests=10)) == 10
    assert len(built) < 100  # the first version built all 10 million first (50 s, 4.5 GB)
