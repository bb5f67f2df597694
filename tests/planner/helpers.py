"""Run `pagedkv plan` in-process through the real CLI edge and capture what it prints."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

from pagedkv.cli import main

# The article's dense GQA record: 8 KV heads x 128 dims x FP16, K and V (seeds/000): c = 4096.
ARTICLE_RECORD_BYTES = 4096


def run_plan(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `pagedkv plan ARGS...`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args])
    return code, out.getvalue(), err.getvalue()


def plan_json(*args: str) -> dict[str, Any]:
    """The JSON that `pagedkv plan ARGS... --json` prints (asserts it succeeded)."""
    code, out, err = run_plan(*args, "--json")
    assert code == 0, err
    assert err == ""
    return json.loads(out)


def rows_by_block_size(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {row["block_size"]: row for row in report["rows"]}
