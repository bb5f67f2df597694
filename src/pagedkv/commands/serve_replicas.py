"""`pagedkv serve --replicas N`: N engine replicas on Ray Serve behind one OpenAI endpoint,
each request routed by pagedkv's prefix-aware policy (docs/ray_serve.md).

The flags of one `serve` (model, KV cache, HTTP) apply to every replica; these add the
replica count, the Ray cluster and the routing. Without --replicas nothing here runs and ray
is never imported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pagedkv.serve_ray.config import REPLICA_ROUTINGS  # imports neither ray nor torch


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "replicas on Ray Serve",
        "With --replicas N, N engines (one KV pool each) run as a Ray Serve application and "
        "--host/--port is Serve's HTTP endpoint; needs pagedkv[ray]. Guide: docs/ray_serve.md",
    )
    g.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="engine replicas (>= 1); with --max-replicas the least Serve's autoscaler keeps",
    )
    g.add_argument(
        "--max-replicas",
        type=int,
        metavar="N",
        help="autoscale between --replicas and this many replicas",
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=4.0,
        metavar="R",
        help="autoscaling: requests per replica Serve aims at (default 4)",
    )
    g.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="join this Ray cluster (e.g. auto, or HOST:6379; default: start a "
        "local Ray and stop it at exit)",
    )
    g.add_argument(
        "--ray-num-cpus",
        type=int,
        metavar="N",
        help="CPUs of the local Ray (default: the machine's)",
    )
    g.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        metavar="C",
        help="Ray CPUs each engine replica takes (default 1)",
    )
    g.add_argument(
        "--replica-gpus",
        type=float,
        metavar="G",
        help="Ray GPUs each engine replica takes (default 1 with --device cuda, else 0)",
    )
    _add_routing_args(g)


def _add_routing_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--replica-routing",
        default="prefix-aware",
        choices=REPLICA_ROUTINGS,
        help="prefix-aware (default): the replica holding the longest prefix within "
        "the balance band, else the least loaded (pagedkv route's policy); "
        "power-of-two: Serve's own router",
    )
    g.add_argument(
        "--balance-abs",
        type=int,
        default=4,
        help="prefix-aware: a prefix holder may be this many requests busier than "
        "the least loaded replica (default 4)",
    )
    g.add_argument(
        "--balance-rel",
        type=float,
        default=0.25,
        help="... or this fraction of the least load, whichever is larger (0.25)",
    )
    g.add_argument(
        "--hint-ttl",
        type=float,
        default=60.0,
        metavar="S",
        help="prefix-aware: the blocks of a request sent to a replica count as held there for "
        "S seconds, until its stats report them (default 60; 0: only the reports count)",
    )
    g.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        metavar="M",
        help="P/D as a Serve graph: M prefill replicas in front of the --replicas decode "
        "replicas, KV through --kv-store (the P/D flags above apply: --kv-import, "
        "--prefill-timeout, ...; default 0: no P/D)",
    )
    g.add_argument(
        "--stats-period",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds between Serve's polls of each replica's load and prefix blocks (default 0.5)",
    )


def pd_configs(args: argparse.Namespace, pd_config: Callable[[argparse.Namespace], Any]):
    """(decode side, prefill side) ``PDConfig``s of a P/D graph, built by ``serve``'s own
    ``pd_config`` (passed in: ``serve`` imports this module); (None, None) without one."""
    if not args.prefill_replicas:
        return None, None
    from dataclasses import replace

    from pagedkv.serve_ray.pd import PREFILL_URL

    args = argparse.Namespace(**vars(args))
    args.role, args.prefill_url = "decode", PREFILL_URL
    decode = pd_config(args)
    return decode, replace(decode, role="prefill", prefill_url=None, kv_import="strict")


def serve_ray_config(
    args: argparse.Namespace,
    engine_cfg: Any,
    server_cfg: Any,
    pd_config: Callable[[argparse.Namespace], Any],
    prefill_engine: Any = None,
):
    from pagedkv.serve_ray.config import ServeRayConfig

    decode, prefill = pd_configs(args, pd_config)
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1.0 if str(engine_cfg.device).startswith("cuda") else 0.0
    return ServeRayConfig(
        engine=engine_cfg,
        server=server_cfg,
        num_replicas=args.replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        routing=args.replica_routing,
        balance_abs=args.balance_abs,
        balance_rel=args.balance_rel,
        stats_period_s=args.stats_period,
        hint_ttl_s=args.hint_ttl,
        replica_num_cpus=args.replica_cpus,
        replica_num_gpus=gpus,
        ray_address=args.ray_address,
        ray_num_cpus=args.ray_num_cpus,
        prefill_replicas=args.prefill_replicas,
        prefill_engine=prefill_engine,
        pd_decode=decode,
        pd_prefill=prefill,
    )


def check_ray_installed() -> None:
    import importlib.util

    from pagedkv.errors import UsageError

    if importlib.util.find_spec("ray") is None:
        raise UsageError(
            "--replicas runs on Ray Serve: install it with "
            "pip install 'pagedkv[ray]' (ray[serve]==2.60.0)",
            "replicas",
        )


def run_replicas(
    args: argparse.Namespace,
    engine_cfg: Any,
    server_cfg: Any,
    pd_config: Callable[[argparse.Namespace], Any],
) -> int:
    from pagedkv.errors import UsageError

    cfg = serve_ray_config(args, engine_cfg, server_cfg, pd_config)  # judged before Ray starts
    if args.role != "both":
        raise UsageError(
            "--replicas with --role: use the P/D application instead "
            "(docs/ray_serve.md, 'P/D as a Serve graph')",
            "role",
        )
    if engine_cfg.tensor_parallel_size > 1:  # a replica's ranks would be processes Ray never sees
        raise UsageError(
            "--replicas with --tensor-parallel-size > 1 is not supported: run `pagedkv serve "
            "--tensor-parallel-size N` replicas behind `pagedkv route` instead",
            "tensor_parallel_size",
        )
    check_ray_installed()
    from pagedkv.serve_ray.launch import run_on_ray

    run_on_ray(cfg)
    return 0
