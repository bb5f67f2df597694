"""What the engine hands back: one ``RequestOutput`` per request, one ``CompletionOutput`` per
sample, and the text bookkeeping behind them (detokenising and stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.model.tokenizer import Tokenizer


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


class TextTracker:
    """Incremental detokenisation of one sample, with stop strings.

    ``update`` is called after each new token; it returns the new printable text and whether a
    stop string was met (the text is then cut before it). Text that ends in an incomplete UTF-8
    sequence is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self.text = ""
        self.stopped = False

    def update(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        full = self._tokenizer.decode(token_ids)
        if full.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        new_start = len(self.text)
        # Only a stop string that ends in the new text can be new; the earliest one wins.
        hits = [full.find(stop, max(0, new_start - len(stop) + 1)) for stop in self._stop]
        hits = [at for at in hits if at != -1]
        if hits:
            full = full[: min(hits)]
            self.stopped = True
        delta = full[new_start:]
        self.text = full
        return delta
