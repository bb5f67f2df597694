"""`pagedkv experiment`: placeholder registered by the lead so that cli.py has one owner; its
helper replaces this file."""

from __future__ import annotations

import argparse

from pagedkv.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("experiment", help="(being built)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    raise UsageError("pagedkv experiment is not built yet")
