"""The router's edge: a request is parsed, judged and tokenized as ``pagedkv serve`` would
(the same pydantic models, the same ``request_params`` translation, hence the same 400s), and
its prompt's block hashes are computed for the prefix-aware policy.

What the router cannot judge without an engine (token ids outside the vocabulary, a request
the replica's whole KV pool could not hold) is left to the replica, whose 400 is passed
through unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from pagedkv.errors import UsageError
from pagedkv.kvcache.hashing import BlockHash, HashExtraKeys
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.routing import prompt_block_hashes
from pagedkv.sched.refusal import never_fits
from pagedkv.server import protocol as p
from pagedkv.server.errors import APIError, from_validation
from pagedkv.server.http_edge import MAX_BODY_BYTES
from pagedkv.server.request_params import engine_inputs

# The cap serve applies by default; a replica started with another cap applies its own.
MAX_SAMPLES_PER_REQUEST = 1024

# The requests a router routes, and their pydantic classes.
RoutedRequest = p.CompletionRequest | p.ChatCompletionRequest
RoutedKind = type[p.CompletionRequest] | type[p.ChatCompletionRequest]


@dataclass(frozen=True)
class _Limits:
    max_model_len: int


class RouterRules:
    """The part of ``EngineRules`` a router can apply: an empty prompt, and a prompt +
    ``max_tokens`` beyond the replicas' context (``sched.refusal``, the engine's own rule)."""

    def __init__(self, max_model_len: int, block_size: int) -> None:
        self.info = _Limits(max_model_len)
        self._block_size = block_size

    def check_request(self, prompt_token_ids: Sequence[int], params) -> None:
        if not prompt_token_ids:
            raise UsageError("the prompt is empty", param="prompt")
        refusal = never_fits(
            len(prompt_token_ids),
            params.max_tokens,
            params.n,
            block_size=self._block_size,
            num_total_blocks=sys.maxsize,
            max_model_len=self.info.max_model_len,
        )
        if refusal is not None:
            raise UsageError(refusal.reason, param=refusal.param, code=refusal.code)


@dataclass(frozen=True)
class RouteKey:
    """What routing needs of a request: its first prompt's full blocks' chained hashes (the
    prompt the index is asked about; a batch of prompts is routed by its first) and whether
    the answer streams."""

    block_hashes: list[BlockHash]
    num_prompt_tokens: int
    stream: bool


class Edge:
    """Judges requests for a router whose replicas serve ``model`` with ``block_size`` and
    ``hash_algorithm``. Thread-safe (the tokenizer is)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        model: str,
        block_size: int,
        hash_algorithm: str,
        max_model_len: int,
    ) -> None:
        self.tokenizer, self.model = tokenizer, model
        self.block_size, self.hash_algorithm = block_size, hash_algorithm
        self.rules = RouterRules(max_model_len, block_size)

    def parse(self, body: bytes, kind: RoutedKind) -> RoutedRequest:
        """The validated request model (a 400 naming the field otherwise)."""
        if len(body) > MAX_BODY_BYTES:
            raise APIError(f"the body exceeds {MAX_BODY_BYTES} bytes", 413, code="body_too_large")
        try:
            req = kind.model_validate_json(body or b"")
        except ValidationError as exc:
            raise from_validation(exc) from None
        if req.model is not None and req.model != self.model:
            raise APIError(
                f"the model {req.model!r} does not exist; this server serves {self.model!r}",
                404,
                param="model",
                code="model_not_found",
            )
        return req

    def route_key(self, req: RoutedRequest) -> RouteKey:
        """Tokenize and judge ``req`` (``APIError`` as serve would answer); slow for long
        prompts: call it off the event loop."""
        inputs = engine_inputs(req, self.tokenizer, self.rules, MAX_SAMPLES_PER_REQUEST)
        prompt = inputs.prompts[0]
        hashes = prompt_block_hashes(
            prompt, self.block_size, HashExtraKeys(cache_salt=req.cache_salt), self.hash_algorithm
        )
        return RouteKey(hashes, len(prompt), bool(req.stream))
