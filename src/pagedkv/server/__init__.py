"""The OpenAI-compatible HTTP server (``pagedkv serve``): a thin edge over one engine loop.

``create_app(engine, ServerConfig(...))`` builds the FastAPI app; ``serve_forever`` and
``start_in_background`` run it under uvicorn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_attributes

# Names resolved on first use (PEP 562), so that importing one torch-free module of this
# package (a router reads the request models and error shapes) does not import torch.
_LAZY = {
    "create_app": "pagedkv.server.app",
    "ServerConfig": "pagedkv.server.config",
    "BackgroundServer": "pagedkv.server.uvicorn_server",
    "bind": "pagedkv.server.uvicorn_server",
    "serve_forever": "pagedkv.server.uvicorn_server",
    "start_in_background": "pagedkv.server.uvicorn_server",
}

if TYPE_CHECKING:
    from pagedkv.server.app import create_app
    from pagedkv.server.config import ServerConfig
    from pagedkv.server.uvicorn_server import (
        BackgroundServer,
        bind,
        serve_forever,
        start_in_background,
    )

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "BackgroundServer",
    "ServerConfig",
    "bind",
    "create_app",
    "serve_forever",
    "start_in_background",
]
