"""Generated tokens' log-probabilities in OpenAI's two layouts.

Chat (``logprobs.content``): each token's ``bytes`` are its raw bytes, so that a character
split over several tokens (an emoji is often two or three) is rebuilt by concatenating them,
which is what the field is for: ``[240, 159]`` for the first half of one, not the UTF-8 of
its vocabulary spelling (``"ðŁ"``, ``[195, 176, 197, 129]``). Its ``token`` is those bytes
decoded with U+FFFD for what is not a whole character, as OpenAI and vLLM send it. The
completions layout keeps the vocabulary spelling (``server/echo.token_str``): its
``top_logprobs`` are keyed by token text, and two halves of characters would share one key.
"""

from __future__ import annotations

import re
from functools import cache

from pagedkv.engine import CompletionOutput
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server import protocol as p
from pagedkv.server.echo import token_str

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def completion_logprobs(
    tokenizer: Tokenizer,
    c: CompletionOutput,
    start: int,
    text_offset: int,
    out: p.CompletionLogprobs | None = None,
) -> p.CompletionLogprobs:
    """The legacy layout for tokens ``start:`` of ``c`` (appended to ``out``); offsets count
    from ``text_offset``."""
    out = p.CompletionLogprobs() if out is None else out
    offset = text_offset
    logprobs = c.logprobs or []
    for k in range(start, len(logprobs)):
        token = token_str(tokenizer, c.token_ids[k])
        out.tokens.append(token)
        out.token_logprobs.append(logprobs[k])
        top = (c.top_logprobs or [])[k]
        alternatives: dict[str, float] = {}
        for t, lp in top:  # best first: two ids with one text keep the better logprob
            alternatives.setdefault(token_str(tokenizer, t), lp)
        out.top_logprobs.append(alternatives)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(tokenizer: Tokenizer, c: CompletionOutput, start: int) -> p.ChoiceLogprobs:
    """The chat layout for tokens ``start:`` of ``c``."""
    content = []
    logprobs = c.logprobs or []
    for k in range(start, len(logprobs)):
        top = [_top(tokenizer, t, lp) for t, lp in (c.top_logprobs or [])[k]]
        lp = logprobs[k]
        chosen = _top(tokenizer, c.token_ids[k], lp if lp is not None else 0.0)
        content.append(p.TokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return p.ChoiceLogprobs(content=content)


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> p.TopLogprob:
    raw = token_bytes(tokenizer, token_id)
    return p.TopLogprob(
        token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw)
    )


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes token ``token_id`` adds to a text. A token that decodes to whole characters
    gives their UTF-8; one that holds part of a character (its decode shows U+FFFD) is read
    from its vocabulary entry: byte-level BPE's printable spelling of bytes (GPT-2, Llama 3,
    Qwen, SmolLM) or SentencePiece's ``<0xNN>``."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text.encode()
    entry = tokenizer.token_text(token_id) or ""
    byte = _BYTE_TOKEN.fullmatch(entry)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    spelled = _byte_level_spelling()
    if entry and all(ch in spelled for ch in entry):
        return bytes(spelled[ch] for ch in entry)
    return text.encode()  # no byte form known: the decoder's own text


@cache
def _byte_level_spelling() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted (GPT-2's ``bytes_to_unicode``):
    printable bytes stand for themselves, the other 68 for U+0100 onwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    spelled = {chr(b): b for b in printable}
    spelled.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return spelled
