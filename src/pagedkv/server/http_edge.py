"""What the HTTP edges of ``pagedkv serve`` and ``pagedkv route`` share: the bearer-key check,
the body limit and the metrics content type. Light on purpose (no engine, no torch): the router
imports it."""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.server.errors import APIError

MAX_BODY_BYTES = 8 << 20
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text format 0.0.4
# Sent instead of a response to a client that already left (nginx's convention).
CLIENT_CLOSED_REQUEST = 499
# Probes answer without the key: a load balancer or Prometheus must not need it.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class BearerAuth:
    """ASGI middleware: with a key, every path but ``OPEN_PATHS`` -- ``/v1`` routes, the
    OpenAPI schema, unknown paths -- needs ``Authorization: Bearer <key>`` (401 otherwise).
    The scheme is matched without regard to case (RFC 7235, section 2.1)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._key and scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
            if not ok:
                error = APIError(
                    "missing or wrong API key (send Authorization: Bearer <key>)",
                    401,
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_body(request: Request) -> bytes:
    """The request body; one over ``MAX_BODY_BYTES`` is refused (413) while it is still
    arriving, before it is held in memory whole."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"the body exceeds {MAX_BODY_BYTES} bytes", 413, code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
