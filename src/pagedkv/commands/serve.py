"""`pagedkv serve`: the engine behind an OpenAI-compatible HTTP API.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming with
"stream": true), GET /health, GET /metrics (Prometheus), GET /pagedkv/info (this replica's
self-description for a router; --kv-events publishes its prefix cache's changes, see
docs/kv_events.md). Listens on 127.0.0.1 unless --host says otherwise. With --api-key (or $PAGEDKV_API_KEY) every /v1 route needs
"Authorization: Bearer KEY" (so do /openapi.json and unknown paths; /health and /metrics stay
open for probes). Without --model the embedded SmolLM2-135M-Instruct is served. The address is
bound before the model loads, so a port in use is reported at once. With --replicas N, N
engines run on Ray Serve behind this address, routed by prefix (docs/ray_serve.md).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from pagedkv.commands.busy_machine import warn_if_busy
from pagedkv.commands.engine_flags import add_engine_args, engine_config
from pagedkv.commands.serve_replicas import add_replica_args
from pagedkv.errors import RankFailure

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
    _add_pd_args(p)
    add_replica_args(p)
    p.set_defaults(func=run)


def _add_pd_args(p: argparse.ArgumentParser) -> None:
    from pagedkv.disagg.config import (
        DEFAULT_BREAKER_BACKOFF_S,
        DEFAULT_BREAKER_FAILURES,
        DEFAULT_PEER_WAIT_S,
        DEFAULT_PREFILL_TIMEOUT_S,
        KV_IMPORT_MODES,
        ROLES,
    )

    g = p.add_argument_group(
        "prefill/decode disaggregation",
        "Two instances share one --kv-store: start `--role prefill` first, then `--role decode "
        "--prefill-url http://HOST:PORT` (clients talk to the decode instance). The decode "
        "instance refuses to start (exit 2) unless both sides' KV page formats match.",
    )
    g.add_argument(
        "--role",
        default="both",
        choices=ROLES,
        help="both: a normal single instance (default); prefill: computes prompts and "
        "writes their KV blocks to the store; decode: asks the prefill instance to "
        "compute each prompt, loads its blocks from the store and decodes",
    )
    g.add_argument("--prefill-url", help="the prefill instance's base URL (--role decode)")
    g.add_argument(
        "--kv-import",
        default="strict",
        choices=KV_IMPORT_MODES,
        help="strict: both sides' page formats must match exactly (default); "
        "relayout: another block size is accepted and the prefill side's blocks are "
        "re-paged into this instance's block size on import",
    )
    g.add_argument(
        "--pd-group",
        default="default",
        help="instances pair only within one group of the store (default 'default')",
    )
    g.add_argument(
        "--pd-wait",
        type=float,
        default=DEFAULT_PEER_WAIT_S,
        help="seconds a decode instance waits for the prefill instance's page "
        f"format at start-up (default {DEFAULT_PEER_WAIT_S:g})",
    )
    g.add_argument(
        "--prefill-timeout",
        type=float,
        default=DEFAULT_PREFILL_TIMEOUT_S,
        help="seconds to wait for one prefill call before computing the prompt "
        f"here (default {DEFAULT_PREFILL_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--prefill-breaker-failures",
        type=int,
        default=DEFAULT_BREAKER_FAILURES,
        metavar="N",
        help="consecutive failed or timed-out prefill calls after which "
        "prompts are computed here without asking the prefill instance, for the "
        f"back-off (default {DEFAULT_BREAKER_FAILURES})",
    )
    g.add_argument(
        "--prefill-breaker-backoff",
        type=float,
        default=DEFAULT_BREAKER_BACKOFF_S,
        metavar="S",
        help="seconds before one request probes the prefill instance "
        "again; doubled after each failed probe, up to a minute "
        f"(default {DEFAULT_BREAKER_BACKOFF_S:g})",
    )


def engine_kv_store(args: argparse.Namespace) -> str | None:
    return args.kv_store


def pd_config(args: argparse.Namespace):
    from pagedkv.disagg import PDConfig

    return PDConfig(
        role=args.role,
        prefill_url=args.prefill_url,
        kv_import=args.kv_import,
        group=args.pd_group,
        peer_wait_s=args.pd_wait,
        prefill_timeout_s=args.prefill_timeout,
        kv_store=engine_kv_store(args),
        breaker_failures=args.prefill_breaker_failures,
        breaker_backoff_s=args.prefill_breaker_backoff,
    )


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
    if args.replicas is not None:  # N engines on Ray Serve (ray is imported only then)
        from pagedkv.commands.serve_replicas import run_replicas

        return run_replicas(args, engine_cfg, config, pd_config)
    pd_cfg = pd_config(args)
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
        warn_if_busy("serve", adapts=not args.fixed_threads, device=args.device)
        engine = LLMEngine(engine_cfg)
    except BaseException:
        sock.close()
        raise
    try:
        pd = _pair_up(pd_cfg, engine, config)
    except BaseException:
        sock.close()
        engine.close()
        raise
    app = create_app(engine, config, pd=pd, flush_store=pd_cfg.role == "prefill")
    app.state.engine_loop.on_fatal = lambda why: _stop_serving(app, why)
    serve_forever(app, config, sock)
    if (why := engine.ranks_failure) is not None:  # a rank died: serving ended, say why
        raise RankFailure(why)
    return 0


def _stop_serving(app, why: str) -> None:
    """A tensor-parallel rank failed: the engine cannot serve; end this server as Ctrl-C
    would (open requests get their error, the workers are stopped), then exit 1."""
    print(f"pagedkv serve: {why}: shutting down", file=sys.stderr, flush=True)
    app.state.uvicorn_server.should_exit = True


def _pair_up(pd_cfg, engine, config):
    """The decode side's front (None for other roles) after the page-format handshake; a
    mismatch is a UsageError (exit 2)."""
    if not pd_cfg.is_pair:
        return None
    from pagedkv.disagg.pairing import pair_up

    # The store's own notion of "the same model" (a digest of the weights), not a name.
    model = engine.parts.model_identity
    peer = pair_up(pd_cfg, engine.parts.page_format, model, api_key=config.api_key)
    print(
        f"pagedkv: P/D role {pd_cfg.role}, group {pd_cfg.group!r}, store {pd_cfg.kv_store}"
        + (
            f"; prefill instance {pd_cfg.prefill_url} (pid {peer.pid} on {peer.host}, "
            f"block_size={peer.page_format.block_size}, tp_size={peer.page_format.tp_size}, "
            f"kv import {pd_cfg.kv_import})"
            if peer
            else ""
        ),
        file=sys.stderr,
    )
    if peer is None:
        return None
    from pagedkv.disagg.prefill_client import prefill_client
    from pagedkv.server.pd_front import PDFront

    importer = None
    if peer.page_format.block_size != engine.parts.page_format.block_size:  # relayout
        from pagedkv.disagg.relayout import RelayoutImporter

        importer = RelayoutImporter.for_engine(engine, peer, pd_cfg.kv_store, model)
    return PDFront(prefill_client(pd_cfg, config.api_key), importer)
