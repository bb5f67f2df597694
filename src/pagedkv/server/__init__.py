"""The OpenAI-compatible HTTP server (``pagedkv serve``): a thin edge over one engine loop.

``create_app(engine, ServerConfig(...))`` builds the FastAPI app; ``serve_forever`` and
``start_in_background`` run it under uvicorn.
"""

from pagedkv.server.app import create_app
from pagedkv.server.config import ServerConfig
from pagedkv.server.runner import BackgroundServer, serve_forever, start_in_background

__all__ = [
    "BackgroundServer",
    "ServerConfig",
    "create_app",
    "serve_forever",
    "start_in_background",
]
