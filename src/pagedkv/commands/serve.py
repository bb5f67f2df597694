"""`pagedkv serve`: the engine behind an OpenAI-compatible HTTP API.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming with
"stream": true), GET /health, GET /metrics (Prometheus). Listens on 127.0.0.1 unless --host
says otherwise. With --api-key (or $PAGEDKV_API_KEY) every /v1 route needs
"Authorization: Bearer KEY" (so do /openapi.json and unknown paths; /health and /metrics stay
open for probes). Without --model the embedded SmolLM2-135M-Instruct is served. The address is
bound before the model loads, so a port in use is reported at once.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from pagedkv.commands.engine_flags import add_engine_args, engine_config

# The cap's default, repeated here so that parsing flags needs no server import (FastAPI is
# slow to import); tests check that the two agree.
DEFAULT_MAX_SAMPLES_PER_REQUEST = 1024

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the model behind an OpenAI-compatible HTTP API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free)")
    g.add_argument(
        "--api-key",
        help="required bearer token for /v1 routes (default: $PAGEDKV_API_KEY; unset = none)",
    )
    g.add_argument("--served-model-name", help="model id clients use (default: from --model)")
    g.add_argument(
        "--max-samples-per-request",
        type=int,
        default=DEFAULT_MAX_SAMPLES_PER_REQUEST,
        help="most prompts x n one request may ask for; more is a 400 "
        f"(default {DEFAULT_MAX_SAMPLES_PER_REQUEST})",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level",
    )
    add_engine_args(p)
    p.set_defaults(func=run)


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name is not None:  # given, even empty: ServerConfig judges it
        return args.served_model_name
    if args.model is None:
        return EMBEDDED_MODEL_NAME
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


def server_config(args: argparse.Namespace):
    from pagedkv.server.config import API_KEY_ENV, ServerConfig

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return ServerConfig(
        served_model_name=served_model_name(args),
        host=args.host,
        port=args.port,
        api_key=api_key,
        log_level=args.log_level,
        max_samples_per_request=args.max_samples_per_request,
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    config = server_config(args)  # validate the edge before loading anything
    engine_cfg = engine_config(args)
    from pagedkv.server import bind, create_app, serve_forever

    sock = bind(config.host, config.port)  # a port in use is an error now, not after the load
    from pagedkv.engine import LLMEngine

    if not _is_loopback(config.host) and config.api_key is None:
        print(
            f"pagedkv serve: warning: listening on {config.host} without --api-key: "
            "anyone who can reach this address can use the model",
            file=sys.stderr,
        )
    try:
        engine = LLMEngine(engine_cfg)
    except BaseException:
        sock.close()
        raise
    serve_forever(create_app(engine, config), config, sock)
    return 0
