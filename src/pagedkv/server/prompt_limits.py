"""The prompt limit, judged before tokenizing: a text longer than the context could ever hold.

A prompt is limited to ``max_model_len`` tokens (with ``max_tokens``: the engine's rule,
``sched/refusal.py``, judged on the token ids). Tokenizing costs about a microsecond per
character, so a text whose length alone proves it is over the limit is refused here, by its
length, before any of it is tokenized: an 8 MB prompt costs the server nothing.

The proof: no token covers more characters of the text than ``chars_per_token_bound``. For a
tokenizer without a normalizer that is its longest vocabulary entry (a byte-level entry has
one character per byte, a sentencepiece one its own characters): the bound is that, times 4
where a normalizer may rewrite the text first, and never under ``MIN_CHARS_PER_TOKEN_BOUND``.
A text of more than ``max_model_len * bound`` characters is therefore more than
``max_model_len`` tokens long. A chat's bound is on its messages' contents, which the chat
template renders into the prompt.
"""

from __future__ import annotations

import weakref

from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.server.protocol_messages import ContentPart

MIN_CHARS_PER_TOKEN_BOUND = 32
_NORMALIZER_FACTOR = 4  # NFC composing, accent stripping: a few characters into one
_BOUNDS: weakref.WeakKeyDictionary[Tokenizer, int] = weakref.WeakKeyDictionary()


def chars_per_token_bound(tokenizer: Tokenizer) -> int:
    """The most characters of a text one token of ``tokenizer`` can cover (generous; computed
    once per tokenizer, from its vocabulary)."""
    bound = _BOUNDS.get(tokenizer)
    if bound is None:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        longest = max((len(t) for t in vocab), default=1)
        if tokenizer.backend.normalizer is not None:
            longest *= _NORMALIZER_FACTOR
        bound = _BOUNDS[tokenizer] = max(longest, MIN_CHARS_PER_TOKEN_BOUND)
    return bound


def max_prompt_chars(tokenizer: Tokenizer, max_model_len: int) -> int:
    """The longest text that could still fit a context of ``max_model_len`` tokens."""
    return max_model_len * chars_per_token_bound(tokenizer)


def check_prompt_chars(
    req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int
) -> None:
    """A 400 naming ``prompt`` (``prompt N`` in a batch) or ``messages`` for a text longer than
    ``max_prompt_chars``; a no-op otherwise. Costs one ``len`` per string."""
    limit = max_prompt_chars(tokenizer, max_model_len)
    if isinstance(req, ChatCompletionRequest):
        num_chars = sum(_content_chars(m.content) + len(m.refusal or "") for m in req.messages)
        what, param = "the messages' contents hold", "messages"
        if num_chars <= limit:
            return
    else:
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        lengths = [len(t) if isinstance(t, str) else 0 for t in texts]
        longest = max(lengths, default=0)
        if longest <= limit:
            return
        num_chars, param = longest, "prompt"
        what = "the prompt has" if len(texts) == 1 else f"prompt {lengths.index(longest)} has"
    raise APIError(
        f"{what} {num_chars} characters; a context of {max_model_len} tokens (max_model_len) "
        f"holds at most {limit} characters of this model's text ({chars_per_token_bound(tokenizer)}"
        " per token at most), so it cannot fit: refused before tokenizing",
        param=param,
        code="context_length_exceeded",
    )


def _content_chars(content: str | list[ContentPart] | None) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # text parts
        return sum(len(part.text or part.refusal or "") for part in content)
    return 0
