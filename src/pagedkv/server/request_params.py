"""From an OpenAI request to the engine's inputs: prompt token ids and ``SamplingParams``.

This module translates; it decides no rule the engine owns. Sampling values are judged by
``SamplingParams``, prompts against the vocabulary, the context and the KV pool by
``engine.check_request``; their ``UsageError`` becomes a 400 whose ``param`` is the request's
field. What is left here is the HTTP edge's own: OpenAI fields we do not implement, the chat
template, the cap on prompts x ``n`` of one request, and a text too long to tokenize
(``prompt_limits``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.engine import SamplingParams
from pagedkv.engine.structured.spec import StructuredOutput
from pagedkv.errors import UsageError
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.echo import NO_ECHO, Echo
from pagedkv.server.errors import APIError, from_usage
from pagedkv.server.prompt_limits import check_prompt_chars
from pagedkv.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pagedkv.server.structured_params import structured_output
from pagedkv.server.tools import ToolUse, tool_messages, tool_use

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions route


class ContextLimit(Protocol):
    """What translating a request reads of the engine's fixed facts (``EngineInfo`` has it;
    so has a router, which has no engine)."""

    @property
    def max_model_len(self) -> int: ...


class EngineRules(Protocol):
    """The part of the engine a handler may use from its own thread."""

    @property
    def info(self) -> ContextLimit: ...

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...


@dataclass(frozen=True)
class EngineInputs:
    """One engine request per prompt, all with ``params``; ``echo`` what the answer repeats."""

    prompts: list[list[int]]
    params: SamplingParams
    echo: Echo = NO_ECHO
    tools: ToolUse | None = None


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """OpenAI fields we accept only at their neutral value."""
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not req.echo:
            raise APIError(
                "max_tokens must be >= 1 (0 only with echo: true, to score the prompt)",
                param="max_tokens",
                code="invalid_value",
            )
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix", code="unsupported")
        if req.best_of not in (None, 1, req.n):
            raise APIError(
                "best_of is not supported (only equal to n)", param="best_of", code="unsupported"
            )


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


def chat_prompt(
    messages_in: Sequence[ChatMessage],
    tokenizer: Tokenizer,
    add_generation_prompt: bool = True,
    use: ToolUse | None = None,
) -> list[int]:
    """The token ids of the messages (and tools) rendered by the model's own chat template."""
    messages, tools = tool_messages(list(messages_in), use, tokenizer.renders_tools)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt, tools)
    except Exception as exc:  # the template's own raise_exception, or no template at all
        raise APIError(
            f"cannot apply the chat template: {exc}", param="messages", code="invalid_value"
        ) from None


def engine_inputs(
    req: CompletionRequest | ChatCompletionRequest,
    tokenizer: Tokenizer,
    engine: EngineRules,
    max_samples_per_request: int,
) -> EngineInputs:
    """Tokenize and judge a request; raise ``APIError`` naming the field. Slow for long
    prompts (tokenizing, scanning ids): call it off the event loop."""
    check_unsupported(req)
    check_prompt_chars(req, tokenizer, engine.info.max_model_len)  # before any tokenizing
    use, calls_grammar = (
        tool_use(req, tokenizer) if isinstance(req, ChatCompletionRequest) else (None, None)
    )
    if isinstance(req, ChatCompletionRequest):
        prompt = chat_prompt(req.messages, tokenizer, True, use)
        if use is not None and use.prefix:  # a forced call's head: the sample continues it
            prompt += tokenizer.encode(use.prefix, add_special_tokens=False)
        prompts = [prompt]
    else:
        prompts = completion_prompts(req, tokenizer)
    params, renames = sampling_params(req, max(len(p) for p in prompts), engine.info, calls_grammar)
    num_samples = len(prompts) * params.n
    if num_samples > max_samples_per_request:
        raise APIError(
            f"this request asks for {len(prompts)} prompt(s) x n = {params.n}, {num_samples} "
            f"samples; a request may ask for at most {max_samples_per_request} "
            "(the server's --max-samples-per-request)",
            param="prompt" if len(prompts) > 1 else "n",
            code="too_many_samples",
        )
    for i, prompt in enumerate(prompts):
        try:
            engine.check_request(prompt, params)
        except UsageError as exc:
            error = from_usage(exc, renames)
            if len(prompts) > 1 and error.param == "prompt":
                error.message = f"prompt {i}: {error.message}"
            raise error from None
    return EngineInputs(prompts, params, _echo(req, prompts, tokenizer), use)


def _echo(req, prompts: list[list[int]], tokenizer: Tokenizer) -> Echo:
    if not isinstance(req, CompletionRequest):
        return NO_ECHO
    texts = None
    if req.echo:  # a text prompt is echoed as sent; token ids as their text
        if isinstance(req.prompt, str):
            texts = (req.prompt,)
        elif req.prompt and all(isinstance(t, str) for t in req.prompt):
            texts = tuple(req.prompt)
        else:
            texts = tuple(tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts)
    return Echo(
        texts,
        legacy_logprobs=req.echo and req.logprobs is not None,
        prompt_logprobs=req.prompt_logprobs is not None,
        score_only=req.echo and req.max_tokens == 0,
    )


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    longest_prompt_tokens: int,
    info: ContextLimit,
    calls_grammar: StructuredOutput | None = None,
) -> tuple[SamplingParams, dict[str, str]]:
    """The engine's ``SamplingParams`` of the request (its ``UsageError`` as a 400), and the
    renames from the engine's field names to the request's (for later errors).
    ``calls_grammar``: the output must be tool calls (``tool_choice`` required or named)."""
    structured = structured_output(req)
    if calls_grammar is not None and structured is not None:
        raise APIError(
            f"{structured.param} and tool_choice both constrain the output; give one",
            param="tool_choice",
            code="invalid_value",
        )
    renames: dict[str, str] = {}
    if isinstance(req, ChatCompletionRequest):
        renames["logprobs"] = "top_logprobs"
        if req.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
    try:
        params = SamplingParams(
            max_tokens=_max_tokens(req, longest_prompt_tokens, info.max_model_len),
            temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
            top_k=0 if req.top_k is None else req.top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            n=req.n,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=_logprobs(req),
            prompt_logprobs=_prompt_logprobs(req),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0,
            logit_bias=_logit_bias(req.logit_bias),
            min_tokens=req.min_tokens or 0,
            structured=calls_grammar or structured,
        )
    except UsageError as exc:
        raise from_usage(exc, renames) from None
    return params, renames


def _max_tokens(
    req: CompletionRequest | ChatCompletionRequest, prompt_tokens: int, max_model_len: int
) -> int:
    if isinstance(req, ChatCompletionRequest):
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError(
                "give max_tokens or max_completion_tokens, not both",
                param="max_completion_tokens",
                code="invalid_value",
            )
        if req.max_completion_tokens is not None:
            return req.max_completion_tokens
        if req.max_tokens is None:  # chat default: up to the end of the context
            return max(max_model_len - prompt_tokens, 1)
        return req.max_tokens
    if req.max_tokens == 0:  # echo only (``check_unsupported``): one token, dropped later
        return 1
    return COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as ``((id, bias), ...)``; ``SamplingParams`` and the
    engine judge the ids and values."""
    out = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(
                f"logit_bias: {key!r} is not a token id", param="logit_bias", code="invalid_value"
            )
        out.append((int(key), value))
    return tuple(out)


def _prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives each prompt token is scored with (None: not scored): vLLM's
    ``prompt_logprobs``, or ``logprobs`` when the prompt is echoed (the larger of the two)."""
    if not isinstance(req, CompletionRequest):
        return None
    echoed = req.logprobs if req.echo else None
    asked = [k for k in (req.prompt_logprobs, echoed) if k is not None]
    return max(asked) if asked else None


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The number of alternatives per token (None: no logprobs); ``SamplingParams`` judges it."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(
                "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
            )
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs
