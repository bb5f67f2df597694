"""Where the shared traces are looked for: the environment variable, then ../shared/traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.errors import UsageError
from pagedkv.traces import (
    require_shared_trace,
    shared_trace,
    shared_traces_candidates,
    shared_traces_dir,
)
from pagedkv.traces.shared import TRACES_DIR_ENV


def _traces_beside(root: Path) -> Path:
    """``root/checkout`` with ``root/shared/traces/t.csv`` beside it; returns the checkout."""
    traces = root / "shared" / "traces"
    traces.mkdir(parents=True)
    (traces / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    (root / "checkout").mkdir()
    return root / "checkout"


def test_the_folder_beside_the_current_directory_comes_first(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TRACES_DIR_ENV, raising=False)
    monkeypatch.chdir(_traces_beside(tmp_path))
    expected = (tmp_path / "shared" / "traces").resolve()
    assert shared_traces_candidates()[0].resolve() == expected
    found = shared_traces_dir()
    assert found is not None and found.resolve() == expected
    trace = shared_trace("t.csv")
    assert trace is not None and trace.resolve() == expected / "t.csv"


def test_the_environment_variable_is_the_only_place_when_set(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(_traces_beside(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv(TRACES_DIR_ENV, str(elsewhere))
    assert shared_traces_candidates() == [elsewhere]
    # A wrong value is "not found", not quietly replaced by ../shared/traces.
    assert shared_traces_dir() is None and shared_trace("t.csv") is None
    elsewhere.mkdir()
    (elsewhere / "t.csv").write_text("x\n")
    assert shared_traces_dir() == elsewhere and shared_trace("t.csv") == elsewhere / "t.csv"


@pytest.mark.parametrize("name", ["no_such_trace.jsonl", "missing/t.csv"])
def test_a_missing_file_is_none(tmp_path, monkeypatch, name: str) -> None:
    monkeypatch.chdir(_traces_beside(tmp_path))
    monkeypatch.setenv(TRACES_DIR_ENV, str(tmp_path / "shared" / "traces"))
    assert shared_trace(name) is None


def test_a_required_trace_that_is_missing_names_every_place(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TRACES_DIR_ENV, raising=False)
    monkeypatch.chdir(_traces_beside(tmp_path))
    assert require_shared_trace("t.csv") == shared_trace("t.csv")
    with pytest.raises(UsageError, match="nope.csv: not found in ") as caught:
        require_shared_trace("nope.csv")
    assert all(str(c) in str(caught.value) for c in shared_traces_candidates())
    assert TRACES_DIR_ENV in str(caught.value)
