"""One warning line at start-up when other processes already keep the cores busy.

The engine's OpenMP threads spin while they wait for each other: when another process holds
the core one of them needs, the whole step waits (on a busy 2-core machine two threads ran 9x
slower than one). Nothing else would tell the user why it is slow, nor that fewer threads help.
"""

from __future__ import annotations

import os
import sys

from pagedkv.cpu_share import usable_cores

# The 1-minute load average of an idle machine is rarely 0 (a shell, cron, the kernel's own
# threads): only a load at least this far above the cores left free counts as busy.
IDLE_LOAD_NOISE = 0.5
QUIET_ENV = "PAGEDKV_NO_BUSY_WARNING"


def busy_warning(
    command: str,
    threads: int,
    cores: int,
    load_1min: float,
    fix: str,
    one_thread: str = "",
    adapts: bool = False,
) -> str | None:
    """The warning when the 1-minute load average (other processes' work: this one has not
    started yet) is above the ``cores - threads`` left free; None otherwise. ``fix`` says how
    to run fewer threads; ``one_thread`` what to do when there is only one already; ``adapts``:
    the engine's steps run fewer threads by themselves (``pagedkv/cpu_share.py``)."""
    if load_1min < cores - threads + IDLE_LOAD_NOISE:
        return None
    if threads > 1 and adapts:
        advice = "its steps run on fewer threads while other processes hold cores"
    elif threads > 1:
        advice = (
            "threads that spin waiting for a busy core can make every step many times slower; "
            f"try {fix}"
        )
    else:
        advice = one_thread or "steps take longer than on a quiet machine"
    return (
        f"pagedkv {command}: warning: this machine is busy (1-minute load {load_1min:.1f} on {cores} cores) and "
        f"pagedkv runs {threads} thread{'' if threads == 1 else 's'}: {advice}"
    )


def warn_if_busy(
    command: str,
    threads: int | None = None,
    fix: str = "OMP_NUM_THREADS=1",
    one_thread: str = "",
    adapts: bool = False,
    device: str = "cpu",
) -> str | None:
    """Print ``busy_warning`` to stderr (and return it) for ``threads`` (default: torch's
    intra-op threads, which pagedkv's kernels use too); nothing where the model runs on a GPU
    (``device``, a ``--device`` value: the CPU threads do no model work there), where no load
    average exists, or where ``$PAGEDKV_NO_BUSY_WARNING`` is set (the test suite sets it: its
    own load is no news). ``UsageError`` for a device that does not exist."""
    if os.environ.get(QUIET_ENV):
        return None
    from pagedkv.model.device import resolve_device

    if resolve_device(device).type != "cpu":
        return None
    try:
        load_1min = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    message = busy_warning(command, threads, usable_cores(), load_1min, fix, one_thread, adapts)
    if message is not None:
        print(message, file=sys.stderr)
    return message
