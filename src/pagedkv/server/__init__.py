"""The OpenAI-compatible HTTP server (``pagedkv serve``): a thin edge over one engine loop.

``create_app(engine, ServerConfig(...))`` builds the FastAPI app; ``serve_forever`` and
``start_in_background`` run it under uvicorn.
"""

from pagedkv.server.app import create_app
from pagedkv.server.config import ServerConfig
from pagedkv.server.uvicorn_server import BackgroundServer, bind, serve_forever, start_in_background

__all__ = [
    "BackgroundServer",
    "ServerConfig",
    "bind",
    "create_app",
    "serve_forever",
    "start_in_background",
]
