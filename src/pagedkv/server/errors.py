"""OpenAI-style errors: one exception type for the routes, and the handlers that turn every
failure (ours, FastAPI's, pydantic's, an unknown route) into ``{"error": {...}}`` JSON."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.errors import UsageError
from pagedkv.server.protocol import ErrorBody, ErrorResponse, dump

log = logging.getLogger("pagedkv.server")

# OpenAI's error "type" for each status we send.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """A request that cannot be served; ``status_code`` is the HTTP status to answer with."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code

    def body(self) -> dict:
        error_type = _TYPES.get(self.status_code, "invalid_request_error")
        return dump(
            ErrorResponse(
                error=ErrorBody(
                    message=self.message, type=error_type, param=self.param, code=self.code
                )
            )
        )

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status_code == 401 else None
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def from_usage(exc: UsageError, renames: dict[str, str] | None = None) -> APIError:
    """A 400 for what the engine's own rules refused; ``param`` is the field it names, renamed
    to the request's spelling where the two differ (``renames``: engine name -> request's)."""
    param = exc.param if exc.param is None else (renames or {}).get(exc.param, exc.param)
    message = str(exc)
    if exc.param and param != exc.param and message.startswith(f"{exc.param} "):
        message = param + message[len(exc.param) :]  # "logprobs must be" -> "top_logprobs ..."
    return APIError(message, param=param, code=exc.code)


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first offending field (``param`` is its dotted path)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(
            f"the body is not valid JSON: {ctx.get('error', first['msg'])}", code="invalid_json"
        )
    if first.get("type") == "model_type" and not loc:
        return APIError("the body must be a JSON object", code="invalid_json")
    # A field typed as a union reports one error per alternative, each under a loc that ends
    # in the alternative's name ("prompt", "str"): name the field, i.e. their common prefix.
    same_field = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    same_field = [other for other in same_field if other[:1] == loc[:1]]
    common = loc
    for other in same_field[1:]:
        n = 0
        while n < min(len(common), len(other)) and common[n] == other[n]:
            n += 1
        common = common[:n]
    param = ".".join(common) or None
    where = f"{param}: " if param else ""
    alternatives = " (nor any other accepted type)" if len(same_field) > 1 else ""
    more = len(errors) - len(same_field)
    tail = f" (and {more} more problems)" if more else ""
    return APIError(f"{where}{first['msg']}{alternatives}{tail}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise answers in OpenAI's shape; nothing leaks a traceback."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(message, exc.status_code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(f"internal error: {type(exc).__name__}", 500).response()
