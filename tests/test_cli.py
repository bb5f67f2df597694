"""The command line's contract: user errors are one line and exit 2, bugs are "internal error"
and exit 1, and a reader that closes the pipe ends the command quietly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv import cli
from pagedkv.errors import UsageError

PLAN = [sys.executable, "-m", "pagedkv", "plan", "--model", "llama-3-8b", "--num-seqs", "64"]


@pytest.mark.parametrize("extra", [["--json"], []], ids=["json", "table"])
def test_a_closed_pipe_ends_quietly(extra: list[str]) -> None:
    # `head -1` reads one line and leaves: the rest of the output meets a closed pipe.
    cmd = " ".join([*PLAN, "--mean-len", "2000", "--block-sizes", ",".join(["16"] * 1), *extra])
    done = subprocess.run(
        f"{cmd} | head -1; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.count("\n") == 1
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert done.returncode in (0, 141)


def _fake_command(exc: BaseException):
    def register(subparsers) -> None:
        p = subparsers.add_parser("boom")

        def run(args) -> int:
            raise exc

        p.set_defaults(func=run)

    return register


@pytest.mark.parametrize(
    ("exc", "code", "words"),
    [
        (UsageError("--flag must be >= 1"), 2, "pagedkv boom: error: --flag must be >= 1"),
        (FileNotFoundError(2, "No such file", "x.csv"), 2, "pagedkv boom: error:"),
        (ValueError("bad internal state"), 1, "pagedkv boom: internal error: ValueError"),
        (KeyError("k"), 1, "internal error: KeyError"),
    ],
)
def test_user_errors_and_bugs_are_told_apart(monkeypatch, capsys, exc, code, words) -> None:
    original = cli.build_parser

    def build_parser():
        parser = original()
        sub = next(a for a in parser._actions if a.dest == "command")
        _fake_command(exc)(sub)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_parser)
    assert cli.main(["boom"]) == code
    err = capsys.readouterr().err
    assert words in err
    assert ("Traceback" in err) == (code == 1)  # a bug shows where it happened; a user error not


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command gets as far as building an engine (the slow model load)."""
    import pagedkv.engine

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(pagedkv.engine, "LLMEngine", load)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--temperature", "1", "--top-p", "1e-300", "hi"], "top_p must be"),
        (["--top-k", str(2**63), "hi"], "top_k must be an integer in [0, 2147483647]"),
        (["--logprobs", "99", "hi"], "logprobs must be"),
        (["hello", ""], "PROMPT 2 is empty"),
        ([], "give at least one PROMPT"),
    ],
)
def test_generate_checks_its_input_before_loading_the_model(no_model_load, capsys, argv, words):
    assert cli.main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv generate: error: ") and words in err
    assert err.count("\n") == 1  # one line, no traceback


def test_a_prompts_file_that_is_not_utf8_is_named_with_its_line(no_model_load, capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"first prompt\nsecond \xff\xfe prompt\n")
    assert cli.main(["generate", "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: not UTF-8" in err


def test_system_without_chat_is_refused_before_the_load(no_model_load, capsys):
    assert cli.main(["generate", "--system", "Be brief.", "hi"]) == 2
    assert "--system needs --chat" in capsys.readouterr().err


def test_a_request_the_pool_can_never_hold_is_a_usage_error(tmp_path, capsys):
    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path)
    argv = ["generate", "--model", str(tmp_path), "-n", "64", "--max-tokens", "100"]
    assert cli.main([*argv, "--kv-cache-memory", "64KiB", "hello"]) == 2
    err = capsys.readouterr().err
    assert "pagedkv generate: error: PROMPT 1: n = 64 samples" in err and "Traceback" not in err


def test_no_parser_takes_an_abbreviation() -> None:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert not parser.allow_abbrev and commands
    assert all(not p.allow_abbrev for p in commands.values())


def test_a_misspelled_flag_is_the_commands_error_with_its_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--max-token", "5", "hello"])  # not taken as --max-tokens
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedkv generate ")
    assert err.endswith("pagedkv generate: error: unrecognized arguments: --max-token\n")
    assert "usage: pagedkv [-h]" not in err


# Issue 27's CLI cases: a malformed URL (IPv6 included) is one line and exit 2, never a
# traceback (they were "internal error: ValueError: Invalid IPv6 URL", exit 1).
DECODE = ["serve", "--role", "decode", "--kv-store", "redis://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["route", "--replica", "http://[::1"], "--replica 'http://[::1' is not an http(s)"),
        (["route", "--replica", "http://[::1]:0"], "the port must be in 1..65535"),
        (["route", "--replica", "http://a:1", "--kv-events", "redis://[::1"],
         "--kv-events 'redis://[::1' is not a redis://HOST:PORT URL: Invalid IPv6 URL"),
        (["route", "--replica", "http://a:1", "--kv-events", "redis://a:99999"], "out of range"),
        ([*DECODE, "--prefill-url", "http://[::1"], "--prefill-url 'http://[::1' is not an"),
        ([*DECODE, "--prefill-url", "http://127.0.0.1:99999"], "out of range 0-65535"),
        ([*DECODE, "--prefill-url", "http://127.0.0.1:0"], "the port must be in 1..65535"),
        ([*DECODE, "--prefill-url", "http://127.0.0.1:"], "a ':' without a port"),
        ([*DECODE, "--prefill-url", "ftp://h:1"], "is not an http(s)://HOST:PORT URL"),
        ([*DECODE, "--prefill-url", "http://u:p@h:1"], "credentials"),
        ([*DECODE, "--prefill-url", "http://h:1/generate"], "no path"),
        ([*DECODE, "--prefill-url", "http://h:1", "--prefill-breaker-failures", "0"],
         "--prefill-breaker-failures must be an integer >= 1"),
        ([*DECODE, "--prefill-url", "http://h:1", "--prefill-breaker-backoff", "nan"],
         "--prefill-breaker-backoff must be a finite number > 0"),
        (["serve", "--kv-events", "redis://[::1"], "Invalid IPv6 URL"),
        (["serve", "--kv-store", "redis://h:0"], "the port must be in 1..65535"),
    ],
)  # fmt: skip
def test_malformed_urls_are_one_line_and_exit_2(no_model_load, capsys, argv, words):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv {argv[0]}: error: ") and words in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("quick", [["--quick"], []], ids=["quick", "full"])
@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--block-sizes", "0"], "--block-sizes: every value must be >= 1"),
        (["--batch-sizes", "x"], "--batch-sizes: expected comma-separated integers"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--max-num-batched-tokens", "-5"], "--max-num-batched-tokens must be >= 1"),
    ],
)
def test_profile_refuses_invalid_grid_flags_with_or_without_quick(
    no_model_load, capsys, tmp_path, quick, flags, words
):
    """``profile --quick --block-sizes 0`` exited 0: --quick replaced the explicit value."""
    argv = ["profile", *quick, *flags, "-o", str(tmp_path / "p.json")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv profile: error: ") and words in err and err.count("\n") == 1


def test_profile_quick_never_overrides_a_flag_the_user_gave():
    from pagedkv.commands.profile import DEFAULT_GRID, QUICK_GRID, _plan

    parse = cli.build_parser().parse_args
    plan = _plan(parse(["profile", "--quick", "--block-sizes", "32,8", "--steps", "5"]))
    assert plan.block_sizes == (8, 32) and plan.steps_per_point == 5  # given: kept
    assert plan.batch_sizes == (1, 2) and QUICK_GRID["batch_sizes"] == "1,2"  # not given: quick
    full = _plan(parse(["profile", "--steps", "4"]))
    assert full.steps_per_point == 4 and full.block_sizes == (16, 64)
    assert DEFAULT_GRID["block_sizes"] == "16,64"


# Issue 53's CLI cases: each was a traceback, an allocator's error (exit 1), a silent exit 0 or a
# message naming an internal field.
@pytest.fixture
def bad_json_files(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)  # RecursionError in json.loads
    null_meta = tmp_path / "null_meta.json"
    null_meta.write_text('{"meta": null, "sections": {}}')
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["calibrate", "--from-gpu-check", "{d}/deep.json", "-o", "{d}/x.json"],
         "it nests too deep"),
        (["simulate", "--clock", "{d}/deep.json", "--synthetic", "requests=5"],
         "it nests too deep"),
        (["calibrate", "--from-gpu-check", "{d}/null_meta.json", "-o", "{d}/x.json"],
         "no GPU preset"),
        (["simulate", "--synthetic", "requests=5", "--clock", "vllm-class", "--cuda-graphs", "on"],
         "--cuda-graphs applies to a pagedkv-triton clock only"),
        (["profile", "--requests", "5", "-o", "{d}/p.json"], "--requests applies to --timeline only"),
        (["serve", "--kv-cache-memory", "0"], "--kv-cache-memory must be at least 1 B"),
    ],
)  # fmt: skip
def test_bad_files_and_flags_are_one_line_and_exit_2(
    no_model_load, bad_json_files, capsys, argv, words
):
    argv = [a.format(d=bad_json_files) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv {argv[0]}: error: ") and words in err, err
    assert err.count("\n") == 1


def test_a_pool_larger_than_the_host_is_a_usage_error(tmp_path, capsys):
    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path)
    capsys.readouterr()
    argv = ["generate", "--model", str(tmp_path), "--kv-cache-memory", "1000TB", "hi"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-memory 909.494 TiB is more than this machine's available memory" in err
    assert err.count("\n") == 1


def test_profile_timeline_refuses_prompts_past_the_context(tmp_path, capsys):
    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path)  # a context of 128 tokens
    capsys.readouterr()
    argv = ["profile", "--timeline", "--model", str(tmp_path), "--max-prompt", "100000000"]
    assert cli.main([*argv, "-o", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert "--max-prompt 100000000 + up to 64 new tokens is more than the model's context" in err
