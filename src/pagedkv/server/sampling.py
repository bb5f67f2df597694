"""From an OpenAI request to the engine's inputs: prompt token ids and ``SamplingParams``.

Everything a request can get wrong is found here, before the engine sees it, and raised as an
``APIError`` naming the field: the engine thread then only meets requests it can run (it still
validates them itself, and its ValueError would reach the client as a 400 too).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine import SamplingParams
from pagedkv.engine.params import MAX_LOGPROBS, MAX_N
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions route
# Below this a temperature is sampled as 0 (greedy), the limit it tends to: dividing fp32
# logits by a subnormal temperature overflows to inf, and the engine's sampler then raises
# inside ``step`` (failing the whole batch), e.g. at 1e-45.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class PoolLimits:
    """What a request must fit: the context (tokens) and the KV pool (blocks of
    ``block_size`` tokens). Fixed once the engine is built."""

    max_model_len: int
    block_size: int
    num_total_blocks: int
    vocab_size: int


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """OpenAI fields we accept only at their neutral value."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0.0):
            raise APIError(f"{name} is not supported (only 0)", param=name, code="unsupported")
    if req.logit_bias:
        raise APIError("logit_bias is not supported", param="logit_bias", code="unsupported")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise APIError("echo is not supported", param="echo", code="unsupported")
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix", code="unsupported")
        if req.best_of not in (None, 1, req.n):
            raise APIError("best_of is not supported (only equal to n)", param="best_of",
                           code="unsupported")  # fmt: skip


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of each prompt of the request (one, or a batch)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        batch: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        batch = [prompt]  # one prompt given as token ids
    else:
        batch = list(prompt)
    if not batch:
        raise APIError("prompt is empty", param="prompt", code="invalid_value")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The token ids of the messages rendered by the model's own chat template."""
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        role = "system" if m.role == "developer" else m.role
        messages.append({"role": role, "content": content or ""})
    try:
        return tokenizer.encode_chat(messages)
    except Exception as exc:  # the template's own raise_exception, or no template at all
        raise APIError(f"cannot apply the chat template: {exc}", param="messages",
                       code="invalid_value") from None  # fmt: skip


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    limits: PoolLimits,
) -> SamplingParams:
    """Validate the request against the prompts and the pool; raise ``APIError`` (400)."""
    longest = max(len(p) for p in prompts)
    for i, p in enumerate(prompts):
        if not p:
            raise APIError(f"prompt {i} is empty", param="prompt", code="invalid_value")
        bad = next((t for t in p if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
                           param="prompt", code="invalid_value")  # fmt: skip
    max_tokens, param = _max_tokens(req, longest, limits)
    if max_tokens <= 0:
        raise APIError(f"{param} must be at least 1, got {max_tokens}", param=param,
                       code="invalid_value")  # fmt: skip
    if longest + max_tokens > limits.max_model_len:
        raise APIError(
            f"the prompt ({longest} tokens) + {param} ({max_tokens}) = {longest + max_tokens} "
            f"tokens exceeds the context of {limits.max_model_len} tokens",
            param=param if longest < limits.max_model_len else "prompt",
            code="context_length_exceeded",
        )
    if not 1 <= req.n <= MAX_N:
        raise APIError(f"n must be in [1, {MAX_N}], got {req.n}", param="n", code="invalid_value")
    _check_pool(req.n, longest, max_tokens, limits)
    logprobs = _logprobs(req)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_temperature(req.temperature),
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            n=req.n,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:
        # SamplingParams appends its own repr; the first clause is the useful part.
        raise APIError(str(exc).split(" (got ")[0], code="invalid_value") from None


def _temperature(value: float | None) -> float:
    if value is None:
        return 1.0  # OpenAI's default
    return 0.0 if 0.0 < value < MIN_TEMPERATURE else value


def _max_tokens(
    req: CompletionRequest | ChatCompletionRequest, prompt_tokens: int, limits: PoolLimits
) -> tuple[int, str]:
    if isinstance(req, ChatCompletionRequest):
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError("give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens", code="invalid_value")  # fmt: skip
        if req.max_completion_tokens is not None:
            return req.max_completion_tokens, "max_completion_tokens"
        if req.max_tokens is None:  # chat default: up to the end of the context
            return max(limits.max_model_len - prompt_tokens, 1), "max_tokens"
        return req.max_tokens, "max_tokens"
    if req.max_tokens is None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens"
    return req.max_tokens, "max_tokens"


def _check_pool(n: int, prompt_tokens: int, max_tokens: int, limits: PoolLimits) -> None:
    """``n`` samples share the prompt's full blocks; each needs its own blocks after them.
    Refuse ``n`` when all samples at their longest cannot be resident in the pool at once."""
    bs = limits.block_size
    shared_blocks = prompt_tokens // bs
    own_blocks = -(-(prompt_tokens + max_tokens) // bs) - shared_blocks
    needed_blocks = shared_blocks + n * own_blocks
    if needed_blocks > limits.num_total_blocks:
        raise APIError(
            f"n = {n} samples of up to {prompt_tokens + max_tokens} tokens need "
            f"{needed_blocks} KV blocks at once; the pool has {limits.num_total_blocks}",
            param="n" if n > 1 else "max_tokens",
            code="kv_pool_too_small",
        )


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs",
                           code="invalid_value")  # fmt: skip
        value, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        value, param = req.logprobs, "logprobs"
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param=param,
                       code="invalid_value")  # fmt: skip
    return value
