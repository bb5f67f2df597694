"""The ``--plot FILE.png`` flag of `plan` and `simulate`, checked before any work is done: a
missing matplotlib or a folder that cannot be made is one error line at once, not after a
replay of minutes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedkv.commands.overwrite import check_overwrite
from pagedkv.errors import UsageError


def prepare_plot_path(path: str, force: bool = False) -> Path:
    """``path`` ready to be written: matplotlib is installed, the folder exists (created if
    missing, as `mkdir -p` would) and the file is not one git tracks unless ``force``
    (``overwrite``). UsageError naming ``--plot`` otherwise."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib (pip install 'pagedkv[plot]')", "--plot")
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--plot: {path!r} is a directory, give a file name", "--plot")
    check_overwrite(target, "--plot", force)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--plot: cannot create the folder of {path!r}: {exc}", "--plot") from None
    return target
