"""``run_on_ray``: ``pagedkv serve --replicas N`` -- start a local Ray (or join
``--ray-address``), run the application on Serve's HTTP proxy at ``--host``/``--port``, and
serve until Ctrl-C or SIGTERM.

Lifecycle: what this process started, it stops. A local Ray it started is shut down whole
(Serve's controller and proxy, the replicas, the raylet, the GCS: ``ray.shutdown`` ends the
node it started); on a joined cluster only this application is deleted and the cluster goes
on. Errors the user can fix are ``UsageError`` (exit 2, one line): an unreachable
``--ray-address``, a port in use, a replica that cannot start (its error's last line).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.serve_ray.config import ServeRayConfig


def _init_ray(cfg: ServeRayConfig) -> bool:
    """Connect to ``cfg.ray_address`` or start a local Ray; True when started here."""
    import ray

    quiet = {
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "configure_logging": True,
        "log_to_driver": True,
    }
    if cfg.ray_address is None:
        ray.init(num_cpus=cfg.ray_num_cpus, **quiet)
        return True
    try:
        ray.init(address=cfg.ray_address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UsageError(
            f"--ray-address {cfg.ray_address}: no Ray cluster answers there ({_last_line(exc)})",
            "ray_address",
        ) from None
    return False


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]


def _terminate_on_sigterm() -> None:
    """SIGTERM ends the process through ``finally`` (Python's default would skip it)."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def start_app(cfg: ServeRayConfig, pd_spec: Any = None) -> None:
    """Serve's proxy on ``cfg.server``'s host and port, and the application, ready (every
    replica's engine loaded). ``UsageError`` for a deploy that failed."""
    from ray import serve

    from pagedkv.serve_ray.app import build_application

    serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
    app = build_application(cfg, pd_spec)
    try:
        serve.run(app, name=cfg.app_name, route_prefix="/", blocking=False)
    except RuntimeError as exc:  # DEPLOY_FAILED: a replica's constructor raised
        raise UsageError(f"the application did not start: {_last_line(exc)}", "replicas") from None


def run_on_ray(cfg: ServeRayConfig, pd_spec: Any = None) -> None:
    """Serve until interrupted; stops what it started, however it ends."""
    from pagedkv.server.uvicorn_server import bind

    bind(cfg.server.host, cfg.server.port).close()  # a port in use: one line now, not later
    _terminate_on_sigterm()
    started = _init_ray(cfg)
    try:
        t0 = time.monotonic()
        start_app(cfg, pd_spec)
        where = "a local Ray (started here)" if started else f"the Ray cluster at {cfg.ray_address}"
        replicas = (
            cfg.num_replicas
            if cfg.max_replicas is None
            else (f"{cfg.num_replicas}..{cfg.max_replicas}")
        )
        print(
            f"pagedkv serve: {replicas} engine replicas on {where}, routing {cfg.routing}; "
            f"ready in {time.monotonic() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        print(
            f"pagedkv serve: listening on http://{cfg.server.host}:{cfg.server.port}/v1", flush=True
        )
        while True:
            time.sleep(3600)
    finally:
        stop(cfg, started)


def stop(cfg: ServeRayConfig, started_ray: bool) -> None:
    """Delete the application (and with a Ray started here, Serve and Ray themselves)."""
    import ray
    from ray import serve

    try:
        if started_ray:
            serve.shutdown()
        else:
            serve.delete(cfg.app_name)
    except Exception as exc:  # noqa: BLE001 - stopping goes on: Ray itself is next
        print(f"pagedkv serve: stopping Serve: {_last_line(exc)}", file=sys.stderr)
    finally:
        ray.shutdown()
