"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes: the server's own tokenizer
and chat template, so that a client can count and build prompts exactly as the generation
routes will see them (a chat's ``count`` equals the ``usage.prompt_tokens`` of the same
messages sent to ``/v1/chat/completions``). No engine step runs; tokenizing happens off the
event loop, as for generation."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pagedkv.server.errors import APIError, from_validation
from pagedkv.server.http_edge import read_body
from pagedkv.server.protocol import ChatMessage, Tool, _Strict
from pagedkv.server.request_params import chat_prompt
from pagedkv.server.tools import ToolUse


class TokenizeRequest(_Strict):
    """A ``prompt`` (text; ``add_special_tokens`` default true) or chat ``messages``
    (rendered by the template, which places its own special tokens; ``add_generation_prompt``
    default true). ``return_token_strs``: also each token's text."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


async def _parse(request: Request, kind: type[_Strict]):
    state = request.app.state
    try:
        req = kind.model_validate_json(await read_body(request) or b"")
    except ValidationError as exc:
        raise from_validation(exc) from None
    served = state.config.served_model_name
    if req.model is not None and req.model != served:
        raise APIError(f"the model {req.model!r} does not exist; this server serves {served!r}",
                       404, param="model", code="model_not_found")  # fmt: skip
    return req


async def tokenize(request: Request) -> JSONResponse:
    req = await _parse(request, TokenizeRequest)
    tokenizer = request.app.state.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of prompt or messages", param="prompt",
                       code="invalid_value")  # fmt: skip
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        use = ToolUse(tools, parse=False) if tools else None
        ids = await asyncio.to_thread(chat_prompt, req.messages, tokenizer,
                                      req.add_generation_prompt, use)  # fmt: skip
    else:
        ids = await asyncio.to_thread(tokenizer.encode, req.prompt, req.add_special_tokens)
    strs = [tokenizer.token_text(t) for t in ids] if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": request.app.state.info.max_model_len,
                         "tokens": ids, "token_strs": strs})  # fmt: skip


async def detokenize(request: Request) -> JSONResponse:
    req = await _parse(request, DetokenizeRequest)
    tokenizer = request.app.state.tokenizer
    vocab = tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens",
                       code="invalid_value")  # fmt: skip
    text = await asyncio.to_thread(tokenizer.decode, req.tokens, False)
    return JSONResponse({"prompt": text})
