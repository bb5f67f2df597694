"""What the engine loop hands a request's ``deliver``: its outputs, or one ``Failure``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.engine import RequestOutput, SamplingParams


@dataclass(frozen=True)
class Failure:
    """Why a request ended without (more) output. ``status_code`` is the HTTP status a handler
    answers with if nothing was sent yet: 400 the engine refused the input (or its own output
    constraint failed while it ran), 503 shutting down or the engine is gone, 500 the request
    failed inside the engine."""

    message: str
    status_code: int
    code: str
    param: str | None = None


# What ``deliver`` receives: a snapshot of the request (kept by the receiver) or a Failure.
Delivery = RequestOutput | Failure
Deliver = Callable[[Delivery], None]


@dataclass(frozen=True)
class Submission:
    """One engine request: a prompt (token ids) of an HTTP request."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str | None
    deliver: Deliver


def failure_of(out: RequestOutput) -> Failure | None:
    """The engine's verdict on a request it ended with ``error`` set, as a Failure."""
    if out.error is None:
        return None
    reasons = {c.finish_reason for c in out.outputs}
    if out.error_param is not None:  # its own output constraint failed inside a step
        return Failure(out.error, 400, "invalid_grammar", out.error_param)
    if "error" in reasons:
        return Failure(out.error, 500, "engine_error")
    return Failure(out.error, 400, "kv_pool_too_small", "prompt")  # refused by the scheduler
