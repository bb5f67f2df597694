"""``build_application``: a ``ServeRayConfig`` as a Ray Serve application: the ``Ingress``
deployment over the ``EngineReplica`` deployment, whose handle routes with
``PagedKVRequestRouter`` (or Serve's power-of-two router, ``routing="power-of-two"``).

The engine deployment: ``num_replicas`` (or ``autoscaling_config`` between ``num_replicas``
and ``max_replicas``), each replica with ``replica_num_cpus`` / ``replica_num_gpus``, and a
``record_routing_stats`` poll every ``stats_period_s``. The ingress needs no CPU of its own
(it tokenizes and forwards). A Serve config file names ``pagedkv.commands.serve_app:app``
(``import_path``) with ``serve``'s flags as ``args``; see docs/ray_serve.md.
"""

from __future__ import annotations

from typing import Any

from pagedkv.serve_ray.config import POWER_OF_TWO, ROUTER_CLASS, ServeRayConfig

ENGINE_DEPLOYMENT = "PagedKVEngine"
INGRESS_DEPLOYMENT = "PagedKVIngress"
# A replica's engine loads its model in __init__: minutes for a large model on a slow disk.
HEALTH_CHECK_PERIOD_S = 2.0
GRACEFUL_SHUTDOWN_TIMEOUT_S = 10.0
# Failed replica constructors before the deploy fails (Serve's default, 20, would keep a bad
# --model loading for minutes before the one-line error). Replacing a replica that died later
# is not a constructor retry: Serve always does that.
CONSTRUCTOR_RETRIES = 2


def _engine_options(cfg: ServeRayConfig) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    router_class = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
    if cfg.routing != POWER_OF_TWO:
        router_class = ROUTER_CLASS
    router = RequestRouterConfig(
        request_router_class=router_class,
        request_router_kwargs=cfg.router_kwargs if cfg.routing != POWER_OF_TWO else {},
        request_routing_stats_period_s=cfg.stats_period_s,
        request_routing_stats_timeout_s=max(10.0, 4 * cfg.stats_period_s),
    )
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": cfg.replica_num_cpus, "num_gpus": cfg.replica_num_gpus},
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "request_router_config": router,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_TIMEOUT_S,
        "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
        "logging_config": cfg.serve_logging,
    }
    if cfg.autoscaling is not None:
        options["autoscaling_config"] = cfg.autoscaling
    else:
        options["num_replicas"] = cfg.num_replicas
    return options


def build_application(cfg: ServeRayConfig) -> Any:
    """The ``serve.Application`` (not yet running): the ingress over the engines, and with
    ``cfg.prefill_replicas`` the engines as the decode side of a prefill deployment."""
    from ray import serve

    from pagedkv.serve_ray.engine_replica import EngineReplica
    from pagedkv.serve_ray.ingress import Ingress

    engine = serve.deployment(EngineReplica).options(**_engine_options(cfg))
    ingress = serve.deployment(Ingress).options(
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4 * cfg.max_ongoing_requests,
        logging_config=cfg.serve_logging,
    )
    if not cfg.prefill_replicas:
        engines = engine.bind(cfg.engine, cfg.server, cfg.max_stats_blocks)
        return ingress.bind(engines, cfg.engine.model)
    from pagedkv.serve_ray.pd import PREFILL_DEPLOYMENT, PDRole

    prefill_options = {
        **_engine_options(cfg),
        "name": PREFILL_DEPLOYMENT,
        "num_replicas": cfg.prefill_replicas,
    }
    prefill_options.pop("autoscaling_config", None)
    prefill = serve.deployment(EngineReplica).options(**prefill_options)
    prefill_engine = cfg.prefill_engine if cfg.prefill_engine is not None else cfg.engine
    prefills = prefill.bind(
        prefill_engine, cfg.server, cfg.max_stats_blocks, PDRole(cfg.pd_prefill)
    )
    decodes = engine.bind(
        cfg.engine, cfg.server, cfg.max_stats_blocks, PDRole(cfg.pd_decode), prefills
    )
    return ingress.bind(decodes, cfg.engine.model)
