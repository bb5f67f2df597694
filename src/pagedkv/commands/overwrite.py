"""Files a command writes never silently replace committed ones.

Run from the checkout, an example's path (``--plot docs/img/plan_example.png``) or a default
folder names a file the repository tracks: writing over it would leave a diff the user did not
ask for. A path git tracks is therefore written only with ``--force`` (what regenerating the
docs' figures passes); any other file, one git ignores or that lies outside a repository, is
overwritten as usual, so rerunning a command into a scratch folder just works.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from pagedkv.errors import UsageError

FORCE_HELP = "overwrite files that git tracks (e.g. to regenerate the figures under docs/)"


def add_force_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--force", action="store_true", help=FORCE_HELP)


def is_tracked_by_git(path: Path) -> bool:
    """True if ``path`` is an existing file that the git repository holding it tracks; False
    outside a repository or where git is not installed."""
    if not path.is_file():
        return False
    try:
        done = subprocess.run(
            [
                "git",
                "-C",
                str(path.resolve().parent),
                "ls-files",
                "--error-unmatch",
                "--",
                path.name,
            ],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def check_overwrite(path: Path, flag: str, force: bool) -> None:
    """``UsageError`` naming ``flag`` if writing ``path`` would replace a file git tracks and
    ``force`` is not given."""
    if not force and is_tracked_by_git(path):
        raise UsageError(
            f"{flag}: {str(path)!r} is a file tracked by git; give --force to overwrite it, "
            "or another path",
            flag,
        )
