"""`pagedkv route`: one OpenAI-compatible front over N `pagedkv serve` replicas.

Clients talk to the router exactly as to `pagedkv serve` (same routes, same errors, streaming
passed through); it sends each request to one replica chosen by --policy:

  round-robin   replicas in turn
  least-loaded  fewest requests in flight + queued (from each replica's /metrics and the
                router's own count)
  prefix-aware  the replica whose prefix cache holds the longest prefix of the request's
                blocks (read from the replicas' KV events), unless it is more than
                --balance-abs requests (or --balance-rel of the least load) busier than the
                least loaded one (default)

At start-up every replica's GET /pagedkv/info must agree on page format, block size, hash,
model, tokenizer and context, and the router's tokenizer (--model) must be theirs; otherwise
the router exits (status 2) naming both sides and the field.
A replica that stops answering is taken out and its requests retried on another; a stream that
already sent tokens ends with an error event. Guide: docs/routing.md.

  pagedkv route --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --port 8080
"""

from __future__ import annotations

import argparse
import os

from pagedkv.router.config import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT_S,
    RouterConfig,
)
from pagedkv.routing import ROUTING_POLICIES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "route",
        help="route OpenAI requests over several `pagedkv serve` replicas (prefix-aware)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat, or a comma list)",
    )
    a(
        "--policy",
        default="prefix-aware",
        choices=ROUTING_POLICIES,
        help="how a replica is chosen (default prefix-aware)",
    )
    a(
        "--kv-events",
        metavar="redis://HOST:PORT",
        help="where the replicas publish KV events, as the router reaches it (default: the URL "
        "each replica's /pagedkv/info names)",
    )
    a(
        "--model",
        help="the replicas' model (GGUF file or Hugging Face folder): only its "
        "tokenizer is read (default: the embedded SmolLM2)",
    )
    a(
        "--balance-abs",
        type=int,
        default=4,
        help="prefix-aware: a prefix holder may be this many requests busier than the least "
        "loaded replica (default 4)",
    )
    a(
        "--balance-rel",
        type=float,
        default=0.25,
        help="... or this fraction of the least load, whichever is larger (default 0.25)",
    )
    a(
        "--health-interval",
        type=float,
        default=DEFAULT_HEALTH_INTERVAL_S,
        metavar="S",
        help=f"seconds between health checks of each replica (default {DEFAULT_HEALTH_INTERVAL_S:g})",
    )
    a(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metavar="S",
        help="seconds to wait for a replica's answer (or, in a stream, its next event) "
        f"(default {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )
    a(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait to connect to a replica (default {DEFAULT_CONNECT_TIMEOUT_S:g})",
    )
    a(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds to wait at start-up for replicas that do not answer yet (default 0)",
    )
    a("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    a("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any)")
    a(
        "--api-key",
        help="bearer token clients must send to /v1 routes, also sent to the "
        "replicas (default: $PAGEDKV_API_KEY; unset = none)",
    )
    a(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level",
    )
    p.set_defaults(func=run)


def router_config(args: argparse.Namespace) -> RouterConfig:
    urls = tuple(u for item in args.replica for u in item.split(",") if u.strip())
    api_key = args.api_key if args.api_key is not None else os.environ.get("PAGEDKV_API_KEY")
    return RouterConfig(
        replica_urls=urls,
        policy=args.policy,
        kv_events_url=args.kv_events,
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=api_key or None,
        balance_abs=args.balance_abs,
        balance_rel=args.balance_rel,
        health_interval_s=args.health_interval,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        wait_s=args.wait,
        log_level=args.log_level,
    )


def run(args: argparse.Namespace) -> int:
    config = router_config(args)  # validate the flags before anything is contacted
    from pagedkv.commands.serve import EMBEDDED_MODEL_NAME
    from pagedkv.router.server import run_router

    run_router(config, EMBEDDED_MODEL_NAME)
    return 0
