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
