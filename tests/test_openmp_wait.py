"""pagedkv's OpenMP wait default: set before torch loads libgomp, never over the user's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, {first}; print(os.environ.get('GOMP_SPINCOUNT'))"


def _probe(first: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        env={**clean, **env}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_importing_pagedkv_first_sets_the_spin_count():
    assert _probe("pagedkv") == "10000"


@pytest.mark.parametrize(
    ("env", "expected"), [({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "None")]
)
def test_a_users_choice_is_kept(env, expected):
    assert _probe("pagedkv", **env) == expected


def test_nothing_is_set_once_torch_has_loaded_libgomp():
    assert _probe("torch, pagedkv") == "None"
