"""What the engine hands back: one ``RequestOutput`` per request, one ``CompletionOutput`` per
sample. Their text comes from the ``Detokenizer`` (engine/detokenizer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class PromptTokenScore(NamedTuple):
    """One prompt token's score (``prompt_logprobs``): its logprob, its rank among all tokens
    (1 = the most likely; ties rank it first), the top alternatives ``[(id, logprob)]``."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One sample of a request. ``text`` excludes any matched stop string."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", "refused"
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request. ``num_cached_tokens`` is the prompt's prefix hit (tokens whose
    KV was reused); of those, ``num_partial_cached_tokens`` came from a partially matched block
    (``kvcache/partial.py``), of which ``num_prefix_copied_tokens`` were copied (0 when the
    block was claimed in place). ``error`` is set (and ``finished``) when the request could not
    run. ``error_param``: the request field the error is traced to (its output constraint, whose
    grammar failed inside a step), else None. ``prompt_logprobs`` (asked for in
    ``SamplingParams``): one entry per prompt token, None for the first (nothing predicts it)
    and for positions the prefill has not reached yet."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    num_partial_cached_tokens: int = 0
    num_prefix_copied_tokens: int = 0
    error: str | None = None
    error_param: str | None = None
    prompt_logprobs: list[PromptTokenScore | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
