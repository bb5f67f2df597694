"""`pagedkv simulate` against hostile input: non-finite numbers, giant requests and sizes,
malformed trace records, a directory. Each is one error line (exit 2) or a skip with a
warning; nothing hangs, nothing materializes a request that can never run."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest

from pagedkv.cli import main

SMALL = ["--synthetic", "requests=4,prompt=100-200,output=5", "--max-model-len", "2k"]
HUGE = "9" * 400 + "TiB"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*SMALL, "--rate-scale", "nan"], "--rate-scale: must be a finite number"),
        ([*SMALL, "--rate-scale", "inf"], "--rate-scale: must be a finite number"),
        ([*SMALL, "--step-overhead-ms", "nan"], "--step-overhead-ms: must be a finite number"),
        ([*SMALL, "--sample-interval", "nan"], "--sample-interval: must be a finite number"),
        ([*SMALL, "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization: must be a fin"),
        (["--synthetic", "requests=2,turns=2,gap=nan"], "synthetic spec: 'gap=nan'"),
        (["--synthetic", "requests=2,rate=nan"], "synthetic spec: 'rate=nan'"),
        ([*SMALL, "--kv-memory", HUGE], "--kv-memory: "),
        ([*SMALL, "--max-model-len", "9" * 400], "--max-model-len: "),
        ([*SMALL, "--max-num-seqs", "²"], "--max-num-seqs: expected a whole number"),
    ],
)
def test_bad_numbers_are_one_line_and_exit_2(args, message, capsys) -> None:
    assert main(["simulate", *args]) == 2  # a NaN used to hang the replay forever
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_directory_is_named_as_such(tmp_path: Path, capsys) -> None:
    assert main(["simulate", "--trace", str(tmp_path)]) == 2
    assert "is a directory, not a trace file" in capsys.readouterr().err


def _trace(tmp_path: Path, bad_line: bytes) -> Path:
    good = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}
    later = {**good, "timestamp": 1000}
    path = tmp_path / "m.jsonl"
    path.write_bytes(json.dumps(good).encode() + b"\n" + bad_line + b"\n"
                     + json.dumps(later).encode() + b"\n")  # fmt: skip
    return path


@pytest.mark.parametrize(
    "bad_line",
    [
        b'{"timestamp": NaN, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}',
        b'{"timestamp": "5", "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}',
        b'{"timestamp": 5, "input_length": 10.5, "output_length": 3, "hash_ids": [0]}',
        b'{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 1.5]}',
        b'{"timestamp": 5, "input_length": 6\xff\xfe0, "output_length": 3, "hash_ids": [0]}',
    ],
)
def test_a_malformed_record_is_skipped_with_file_line_or_fails_under_strict(
    tmp_path: Path, bad_line: bytes, capsys
) -> None:
    path = _trace(tmp_path, bad_line)
    args = ["simulate", "--trace", str(path), "--policy", "vllm", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert f"skipped 1 unparsable line(s): {path}:2: " in captured.err
    runs = json.loads(captured.out)
    assert runs[0]["num_requests"] == 2 and "NaN" not in captured.out
    assert main([*args, "--strict"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: " in err and len(err.strip().splitlines()) == 1


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_a_two_billion_token_prompt_is_refused_before_it_is_built(tmp_path: Path, capsys) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,100,5\n"
        "2023-11-16 18:15:47.0,2000000000,10\n2023-11-16 18:15:48.0,200,5\n"
    )
    before = _rss_kib()
    assert main(["simulate", "--trace", str(path), "--policy", "reserved,vllm", "--json"]) == 0
    assert _rss_kib() - before < 200_000  # KiB: the 2e9 token ids (8 GB) were never built
    for run in json.loads(capsys.readouterr().out):
        assert (run["num_requests"], run["refused"], run["num_finished"]) == (3, 1, 2)


def test_a_giant_synthetic_system_prompt_is_refused_fast(capsys) -> None:
    before = _rss_kib()
    args = ["simulate", "--synthetic", "requests=5,system=99999999", "--policy", "vllm", "--json"]
    assert main(args) == 0
    assert _rss_kib() - before < 200_000  # KiB: was 2.4 GB (and 32 s) to refuse 5 requests
    (run,) = json.loads(capsys.readouterr().out)
    assert run["refused"] == 5 and run["num_finished"] == 0


def test_a_trace_whose_every_line_is_bad_says_why_it_is_empty(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": "x", "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": 10.5, "output_length": 2, "hash_ids": [1]}\n'
    )
    assert main(["simulate", "--trace", str(path), "--policy", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "the workload has no requests (skipped 2 unparsable line(s)" in err
    assert f"{path}:1:" in err and f"{path}:2:" in err and err.count("\n") == 1


def test_a_plot_path_that_cannot_be_written_is_refused_before_the_replay(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["simulate", "--synthetic", "requests=3", "--policy", "vllm", "--json"]
    assert main([*args, "--plot", str(blocker / "p.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing was replayed
    assert "--plot: cannot create the folder" in captured.err
    # A missing folder is made, as `plan --plot` does.
    assert main([*args, "--plot", str(tmp_path / "new" / "p.png")]) == 0
    assert (tmp_path / "new" / "p.png").stat().st_size > 0
