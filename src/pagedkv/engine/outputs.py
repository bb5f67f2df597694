"""What the engine hands back: one ``RequestOutput`` per request, one ``CompletionOutput`` per
sample. Their text comes from the ``Detokenizer`` (engine/detokenizer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    KV was reused). ``error`` is set (and ``finished``) when the request could not run."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
