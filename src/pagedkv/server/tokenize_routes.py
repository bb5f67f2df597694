"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, in vLLM's shapes: the
server's own tokenizer and chat template, so that a client can count and build prompts exactly
as the generation routes will see them (a chat's ``count`` equals the ``usage.prompt_tokens``
of the same messages sent to ``/v1/chat/completions``). lm-evaluation-harness's remote
tokenizer reads exactly these. No engine step runs; tokenizing happens off the event loop, as
for generation. ``pagedkv route`` serves them too, from its own copy of the replicas'
tokenizer (their fingerprints match, checked at start-up)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.errors import APIError, from_validation
from pagedkv.server.http_edge import read_body
from pagedkv.server.protocol import ChatMessage
from pagedkv.server.protocol_base import Strict as _Strict
from pagedkv.server.protocol_tools import Tool
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


@dataclass(frozen=True)
class TokenizerFacts:
    tokenizer: Tokenizer
    served_model_name: str
    max_model_len: int


def install_tokenizer_routes(app: FastAPI, facts: TokenizerFacts) -> None:
    app.state.tokenizer_facts = facts
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])


async def tokenizer_info(request: Request) -> JSONResponse:
    """The tokenizer's identity and special tokens, as vLLM's ``/tokenizer_info``."""
    facts: TokenizerFacts = request.app.state.tokenizer_facts
    tok = facts.tokenizer
    text = {i: tok.token_text(i) for i in (tok.bos_token_id, tok.eos_token_id) if i is not None}
    return JSONResponse(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model": facts.served_model_name,
            "model_max_length": facts.max_model_len,
            "vocab_size": tok.vocab_size,
            "bos_token": text.get(tok.bos_token_id),
            "eos_token": text.get(tok.eos_token_id),
            "pad_token": None,
            "add_bos_token": tok.encode("a") != tok.encode("a", False),
            "stop_token_ids": sorted(tok.stop_token_ids),
            "chat_template": tok.chat_template,
            "fingerprint": tok.fingerprint(),
        }
    )


async def _parse(request: Request, kind: type[_Strict]):
    facts: TokenizerFacts = request.app.state.tokenizer_facts
    try:
        req = kind.model_validate_json(await read_body(request) or b"")
    except ValidationError as exc:
        raise from_validation(exc) from None
    served = facts.served_model_name
    if req.model is not None and req.model != served:
        raise APIError(
            f"the model {req.model!r} does not exist; this server serves {served!r}",
            404,
            param="model",
            code="model_not_found",
        )
    return req


async def tokenize(request: Request) -> JSONResponse:
    req = await _parse(request, TokenizeRequest)
    facts: TokenizerFacts = request.app.state.tokenizer_facts
    tokenizer = facts.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(
            "give exactly one of prompt or messages", param="prompt", code="invalid_value"
        )
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        use = ToolUse(tools, parse=False) if tools else None
        ids = await asyncio.to_thread(
            chat_prompt, req.messages, tokenizer, req.add_generation_prompt, use
        )
    else:
        ids = await asyncio.to_thread(tokenizer.encode, req.prompt, req.add_special_tokens)
    strs = [tokenizer.token_text(t) for t in ids] if req.return_token_strs else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": facts.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: Request) -> JSONResponse:
    req = await _parse(request, DetokenizeRequest)
    tokenizer = request.app.state.tokenizer_facts.tokenizer
    vocab = tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            f"token id {bad} is outside the vocabulary [0, {vocab})",
            param="tokens",
            code="invalid_value",
        )
    text = await asyncio.to_thread(tokenizer.decode, req.tokens, False)
    return JSONResponse({"prompt": text})
