"""Where the shared real traces live: one answer for the experiments, benchmarks and tests.

The real traces (Azure LLM 2023 ``conv``/``code``, Mooncake ``conversation``) are not shipped
with pagedkv: they sit in a ``shared/traces`` folder beside the checkout (``../shared/traces``),
on a developer's machine and in CI alike. ``PAGEDKV_TRACES_DIR`` names another folder; when it
is set it is the only place looked at, so that a wrong value shows up as "not found" instead of
being quietly replaced by a default.

    shared_trace("mooncake_conversation.jsonl")   # a Path, or None when it is not here
    require_shared_trace("azure_llm_2023_conv.csv")   # a Path, or UsageError naming the places
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedkv.errors import UsageError

TRACES_DIR_ENV = "PAGEDKV_TRACES_DIR"
# src/pagedkv/traces/shared.py -> the checkout (in an installed package: a folder that merely
# lacks ../shared/traces, which is harmless).
_CHECKOUT = Path(__file__).resolve().parents[3]


def shared_traces_candidates() -> list[Path]:
    """The folders looked in, in order: ``$PAGEDKV_TRACES_DIR`` alone when it is set (and not
    empty); else ``../shared/traces`` from the current directory, then beside the source
    checkout (the same folder is listed once)."""
    override = os.environ.get(TRACES_DIR_ENV)
    if override:
        return [Path(override).expanduser()]
    candidates: list[Path] = []
    for base in (Path.cwd().parent, _CHECKOUT.parent):
        folder = base / "shared" / "traces"
        if all(folder.resolve() != c.resolve() for c in candidates):
            candidates.append(folder)
    return candidates


def shared_traces_dir() -> Path | None:
    """The first of ``shared_traces_candidates()`` that is a folder, or None."""
    return next((c for c in shared_traces_candidates() if c.is_dir()), None)


def shared_trace(name: str) -> Path | None:
    """The trace file ``name`` (e.g. ``"azure_llm_2023_conv.csv"``) in the first candidate
    folder that holds it, or None."""
    return next((c / name for c in shared_traces_candidates() if (c / name).is_file()), None)


def require_shared_trace(name: str) -> Path:
    """``shared_trace(name)``, or UsageError ``"NAME: not found in A or B (...)"`` naming every
    folder looked in and the variable that names another."""
    path = shared_trace(name)
    if path is None:
        places = " or ".join(str(c) for c in shared_traces_candidates())
        raise UsageError(f"{name}: not found in {places} (${TRACES_DIR_ENV} names another folder)")
    return path
