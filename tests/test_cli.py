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
