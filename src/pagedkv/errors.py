"""Errors every layer may raise; this module imports nothing of pagedkv, so any layer can use it.

``UsageError``: the user asked for something invalid (a flag, a file, a request field). Edges
print it as one line (the CLI, exit 2) or answer it as a 400 (the server, ``param`` names the
field). ``RankFailure``: a tensor-parallel rank died or failed, and the engine cannot go on:
the edges end with that one line. Any other exception is an internal error and is reported as
one. ``read_json``: a file the user named, as JSON, or that UsageError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class UsageError(ValueError):
    """Bad input from the user. ``param`` names the offending field or flag when there is one;
    ``code`` says what kind of problem it is (the server's ``error.code``).

    It subclasses ``ValueError`` so callers that validate with ``except ValueError`` keep
    working, but edges must catch ``UsageError`` (not every ``ValueError``) as "the user's fault".
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # a machine-readable kind, e.g. "context_length_exceeded"


class RankFailure(RuntimeError):
    """A rank of a tensor-parallel engine died, raised or stopped answering: its collectives
    cannot complete, so the engine stops (every rank) instead of containing it to a request.
    The message names the rank and what happened to it."""


def read_json(path: str | Path, what: str) -> Any:
    """The JSON in ``path``; UsageError "cannot read WHAT 'PATH': why" when the file cannot be
    read, is not UTF-8, is not JSON or nests too deep for the parser (what it holds is the
    caller's to check)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {what} {str(path)!r}: {exc}") from None
    except RecursionError:
        raise UsageError(f"cannot read {what} {str(path)!r}: it nests too deep") from None
