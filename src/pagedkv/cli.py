"""The `pagedkv` command line: a thin edge that parses arguments and calls the library.

Every command lives in ``pagedkv.commands.<name>``. A ``UsageError`` (the user asked for
something invalid) or a file the user named that cannot be opened becomes one clear error line
and exit code 2. Any other exception is a bug: it prints its traceback and "internal error",
exit 1, never dressed up as the user's mistake. A reader that closes the pipe early
(``pagedkv plan --json | head -1``) ends the command quietly with the conventional 141.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

import rich.console

from pagedkv import __version__
from pagedkv.errors import RankFailure, UsageError

# The order here is the order in `pagedkv --help`.
COMMAND_MODULES: tuple[str, ...] = (
    "pagedkv.commands.demo",
    "pagedkv.commands.generate",
    "pagedkv.commands.plan",
    "pagedkv.commands.capacity",
    "pagedkv.commands.simulate",
    "pagedkv.commands.experiment",
    "pagedkv.commands.profile",
    "pagedkv.commands.calibrate",
    "pagedkv.commands.serve",
    "pagedkv.commands.route",
)


class Parser(argparse.ArgumentParser):
    """No abbreviations: ``--max-token`` is a mistake to report, not ``--max-tokens`` (and a
    flag added later would silently change what an old abbreviation meant)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class CommandParser(Parser):
    """A command's parser: an argument it does not know is this command's error, with its own
    usage (`pagedkv generate: error: ...`), not handed up to the top-level parser."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pagedkv",
        description=(
            "An LLM inference engine built around a paged KV cache, with a block-size planner "
            "and a trace simulator. Run `pagedkv COMMAND --help` for each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=CommandParser
    )
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def _closed_pipe(console: rich.console.Console) -> None:
    """rich's default for a closed pipe is a bare ``SystemExit(1)``; hand it to ``main``'s one
    closed-pipe rule instead (the CLI owns the process, so it may set this for every console)."""
    console.quiet = True
    raise BrokenPipeError


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rich.console.Console.on_broken_pipe = _closed_pipe  # type: ignore[method-assign]
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe must surface here, not at exit
        return code
    except UsageError as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left
    except RankFailure as exc:  # a tensor-parallel rank died or failed: every rank is stopped
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence: report, exit 1
        traceback.print_exc()
        print(
            f"pagedkv {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(this is a bug in pagedkv, not in your input)",
            file=sys.stderr,
        )
        return 1
