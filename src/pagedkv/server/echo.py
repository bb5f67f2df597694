"""The prompt in a completion's answer: ``echo`` and prompt log-probabilities.

``echo: true`` puts each prompt's text before its completions' text; with ``logprobs: k`` the
legacy ``logprobs`` lists then start with the prompt's tokens (the first one's logprob and
alternatives ``null``, as OpenAI and vLLM send them), which is how evaluation harnesses score a
continuation. vLLM's ``prompt_logprobs: k`` instead adds a per-token list of
``{token id: {logprob, rank, decoded_token}}`` (the top k plus the prompt token itself).
``max_tokens: 0`` with ``echo`` scores the prompt without generating: the engine samples one
token (its prefill yields it anyway) and this module drops it from the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedkv.engine import CompletionOutput, RequestOutput
from pagedkv.engine.outputs import PromptTokenScore
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server import protocol as p


@dataclass(frozen=True)
class Echo:
    """What a completions answer repeats of its prompts. ``texts[i]``: prompt ``i`` as echoed
    (None: no echo); ``legacy_logprobs``: the prompt's tokens lead the ``logprobs`` lists;
    ``prompt_logprobs``: vLLM's per-choice ``prompt_logprobs``; ``score_only``: max_tokens 0."""

    texts: tuple[str, ...] | None = None
    legacy_logprobs: bool = False
    prompt_logprobs: bool = False
    score_only: bool = False


NO_ECHO = Echo()


def token_str(tokenizer: Tokenizer, token_id: int) -> str:
    """The token's text; a token that is only part of a UTF-8 character has none of its own,
    so its vocabulary entry is used (unique, unlike the replacement character)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:
        return tokenizer.token_text(token_id) or text
    return text


def without_generation(out: RequestOutput) -> RequestOutput:
    """``out`` with the sampled token of a ``max_tokens: 0`` request removed."""
    outs = [
        CompletionOutput(
            c.index,
            finish_reason="length" if c.finished else None,
            logprobs=None if c.logprobs is None else [],
            top_logprobs=None if c.top_logprobs is None else [],
        )
        for c in out.outputs
    ]
    return replace(out, outputs=outs)


def prompt_legacy_logprobs(
    tokenizer: Tokenizer, out: RequestOutput, into: p.CompletionLogprobs
) -> int:
    """Append the prompt's tokens to ``into`` (offsets from 0); returns the next offset."""
    offset = 0
    scores = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for token_id, score in zip(out.prompt_token_ids, scores, strict=True):
        token = token_str(tokenizer, token_id)
        into.tokens.append(token)
        into.text_offset.append(offset)
        offset += len(token)
        if score is None:
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
            continue
        into.token_logprobs.append(score.logprob)
        alternatives = {token_str(tokenizer, t): lp for t, lp in reversed(score.top)}
        # The prompt token itself is always listed (two ids of one text keep the better).
        alternatives[token] = max(alternatives.get(token, score.logprob), score.logprob)
        into.top_logprobs.append(dict(sorted(alternatives.items(), key=lambda kv: -kv[1])))
    return offset


def vllm_prompt_logprobs(tokenizer: Tokenizer, out: RequestOutput) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None or ``{id: {logprob, rank,
    decoded_token}}`` for the top alternatives and the prompt token."""
    result: list[dict | None] = []
    for token_id, score in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=True):
        result.append(None if score is None else _entry(tokenizer, token_id, score))
    return result


def _entry(tokenizer: Tokenizer, token_id: int, score: PromptTokenScore) -> dict:
    entry = {}
    for rank, (t, lp) in enumerate(score.top, start=1):
        entry[str(t)] = _scored(tokenizer, t, lp, rank)
    entry[str(token_id)] = _scored(tokenizer, token_id, score.logprob, score.rank)
    return entry


def _scored(tokenizer: Tokenizer, token_id: int, logprob: float, rank: int) -> dict:
    text = token_str(tokenizer, token_id)
    return {"logprob": p.finite_logprob(logprob), "rank": rank, "decoded_token": text}
