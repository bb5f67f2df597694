"""The `pagedkv` command line: a thin edge that parses arguments and calls the library.

Every command lives in ``pagedkv.commands.<name>``. A ``UsageError`` (or ``ValueError`` raised
while validating input at the edge) becomes one clear error line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pagedkv import __version__
from pagedkv.errors import UsageError

# The order here is the order in `pagedkv --help`.
COMMAND_MODULES: tuple[str, ...] = (
    "pagedkv.commands.demo",
    "pagedkv.commands.generate",
    "pagedkv.commands.plan",
    "pagedkv.commands.simulate",
    "pagedkv.commands.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description=(
            "An LLM inference engine built around a paged KV cache, with a block-size planner "
            "and a trace simulator. Run `pagedkv COMMAND --help` for each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError) as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
