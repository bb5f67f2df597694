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
import re
import signal
import socket
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
    check_reachable(cfg.ray_address)
    try:
        ray.init(address=cfg.ray_address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UsageError(
            f"--ray-address {cfg.ray_address}: no Ray cluster answers there ({_last_line(exc)})",
            "ray_address",
        ) from None
    return False


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``UsageError`` now for a ``HOST:PORT`` (or ``ray://HOST:PORT``) where nothing
    listens: Ray's own client would retry for minutes. ``auto`` is Ray's to resolve."""
    if address == "auto":
        return
    client = address.startswith("ray://")
    hostport = address.removeprefix("ray://").rstrip("/")
    host, _, port_text = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    try:
        port = int(port_text) if port_text else (10001 if client else 6379)
        socket.create_connection((host.strip("[]"), port), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"--ray-address {address}: no Ray cluster answers there ({exc}); "
            "start one with `ray start --head` or leave the flag out to start a "
            "local Ray",
            "ray_address",
        ) from None


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]


def _terminate_on_sigterm() -> None:
    """SIGTERM ends the process through ``finally`` (Python's default would skip it)."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def start_app(cfg: ServeRayConfig) -> None:
    """Serve's proxy on ``cfg.server``'s host and port, and the application, ready (every
    replica's engine loaded). ``UsageError`` for a deploy that failed."""
    from ray import serve

    from pagedkv.serve_ray.app import build_application

    serve.start(
        http_options={"host": cfg.server.host, "port": cfg.server.port},
        logging_config=cfg.serve_logging,
    )
    app = build_application(cfg)
    try:
        serve.run(app, name=cfg.app_name, route_prefix="/", blocking=False)
    except RuntimeError as exc:  # DEPLOY_FAILED: a replica's constructor raised
        why = _replica_error(cfg.app_name) or _last_line(exc)
        raise UsageError(f"a replica could not start: {why}", "replicas") from None


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception): (?!Traceback).+")


def _replica_error(app_name: str) -> str | None:
    """The last ``SomeError: message`` line of the failed deployment's status (the replica
    constructor's own error), or None."""
    from ray import serve

    try:
        app = serve.status().applications[app_name]
    except Exception:  # noqa: BLE001 - the caller falls back to Serve's own message
        return None
    for dep in app.deployments.values():
        lines = [ln for ln in (dep.message or "").splitlines() if _ERROR_LINE.match(ln)]
        if lines:
            return lines[-1].strip()[:600]
    return None


def run_on_ray(cfg: ServeRayConfig) -> None:
    """Serve until interrupted; stops what it started, however it ends."""
    from pagedkv.server.uvicorn_server import bind

    bind(cfg.server.host, cfg.server.port).close()  # a port in use: one line now, not later
    started = _init_ray(cfg)
    try:
        _terminate_on_sigterm()  # after ray.init, whose own handler aborts the process
        t0 = time.monotonic()
        start_app(cfg)
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
