"""The scheduler's limits: their defaults and the one rule that checks each of them.

``SchedulerConfig`` (``sched/config.py``) owns these limits: its fields default to the values
here and it validates them with these functions. They live in their own module, below
``queues.py`` and ``config.py``, so that ``Scheduler``'s keyword defaults, ``EngineConfig`` and
the engine's flags read the same numbers without an import circle, and the engine's edge asks
the same rule rather than keeping a copy of it.

The defaults are the real engine's (they were ``EngineConfig``'s and the engine flags'): the
engine runs on CPU, where a step's time grows with its tokens, so a smaller budget keeps running
streams from waiting behind one long prefill chunk. ``pagedkv simulate`` models a vLLM
deployment on a GPU and passes vLLM's defaults (256 and 8,192) explicitly
(``sim/simulate_config.py``).

Every check raises ``UsageError`` (a ``ValueError``) naming the field: at the engine's edge
these are the user's flags.
"""

from __future__ import annotations

from pagedkv.errors import UsageError
from pagedkv.sched.preemption import PREEMPTION_MODES, get_victim_policy

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_PREEMPTION = "latest_arrival"
DEFAULT_PREEMPTION_MODE = "recompute"


def _check_whole(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name} must be >= {minimum} (an integer), got {value!r}", name)


def check_limits(
    max_num_seqs: object, max_num_batched_tokens: object, max_model_len: object
) -> None:
    """Running sequences and tokens per step: integers >= 1; ``max_model_len`` None (no limit
    of the scheduler's own) or an integer >= 2 (a prompt token and a generated one)."""
    _check_whole("max_num_seqs", max_num_seqs, 1)
    _check_whole("max_num_batched_tokens", max_num_batched_tokens, 1)
    if max_model_len is not None:
        _check_whole("max_model_len", max_model_len, 2)


def check_preemption(preemption: object, preemption_mode: object) -> None:
    """``preemption``: a victim policy's name (``preemption.py``); ``preemption_mode``: one of
    ``PREEMPTION_MODES``."""
    if not isinstance(preemption, str):
        raise UsageError(f"preemption must be a name, got {preemption!r}", "preemption")
    try:
        get_victim_policy(preemption)
    except ValueError as exc:  # the registry lists the choices
        raise UsageError(str(exc), "preemption") from None
    if preemption_mode not in PREEMPTION_MODES:
        raise UsageError(
            f"unknown preemption_mode {preemption_mode!r}: preemption_mode must be one of "
            f"{', '.join(PREEMPTION_MODES)}",
            "preemption_mode",
        )


def check_swap_space(
    preemption_mode: str, amount: object, field: str, flag: str | None = None
) -> None:
    """The swap space ``amount`` (field ``field``, in its own unit: host bytes at the engine's
    edge, token slots in the scheduler) is an integer >= 0, > 0 under ``swap`` and 0 under
    ``recompute``. ``flag``: the command-line flag the user gave it with, which the messages
    and ``param`` then name (``--swap-space`` -> ``swap_space``); None: they name the field."""
    param = flag.lstrip("-").replace("-", "_") if flag else field
    if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
        raise UsageError(f"{field} must be an integer >= 0, got {amount!r}", param)
    swap = "--preemption-mode swap" if flag else "preemption_mode='swap'"
    if preemption_mode == "swap" and amount == 0:
        raise UsageError(f"{swap} needs {f'a {flag} SIZE' if flag else field} > 0", param)
    if preemption_mode == "recompute" and amount:
        given = flag or f"{field}={amount}"
        raise UsageError(
            f"{given} is only used with {swap} (recompute keeps nothing in host memory)", param
        )
