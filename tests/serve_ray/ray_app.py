"""Helpers of the Ray tests: one local Ray per test module (2 CPUs; replicas take none), a
tiny random model, the application started with ``launch.start_app`` as ``serve --replicas``
starts it, and loopback HTTP to Serve's proxy."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.serve_ray.config import ServeRayConfig
from pagedkv.server import ServerConfig
from tests.kvstore.redis_server import free_port

MODEL_NAME = "tiny"
TIMEOUT_S = 60.0


def tiny_model(folder: Path, context_len: int = 2048) -> Path:
    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", folder, context_len=context_len)
    return folder


@contextlib.contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[int]:
    """A local Ray for one test module; yields the free port Serve's proxy will listen on.
    Ray and Serve are shut down afterwards (their processes end with them)."""
    import ray
    from ray import serve

    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        yield free_port()
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def app_config(model: Path, port: int, **overrides) -> ServeRayConfig:
    """Two replicas of ``model`` (no CPU reserved each), a small KV pool, blocks of 4."""
    engine = EngineConfig(
        model=str(model),
        kv_cache_memory_bytes=8 << 20,
        block_size=4,
        max_num_seqs=8,
        log_startup=False,
    )
    fields = dict(
        engine=engine,
        server=ServerConfig(MODEL_NAME, port=port, log_level="warning"),
        num_replicas=2,
        replica_num_cpus=0.0,
        stats_period_s=0.2,
    )
    fields.update(overrides)
    return ServeRayConfig(**fields)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def complete(base: str, prompt: str, max_tokens: int = 2, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT_S)


def replica_of(resp: httpx.Response) -> str:
    return resp.headers["x-pagedkv-replica"]


def cached_tokens(resp: httpx.Response) -> int:
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def router_view(base: str) -> dict:
    """The ingress's router (``/pagedkv/replicas``): replica -> its row."""
    routers = httpx.get(f"{base}/pagedkv/replicas", timeout=TIMEOUT_S).json()["routers"]
    return {row["replica"]: row for r in routers for row in r["replicas"]}


def engine_replicas(app_name: str, deployment: str = "PagedKVEngine") -> dict[str, str]:
    """Live replica id -> its actor's name (Serve names replica actors
    ``SERVE_REPLICA::APP#DEPLOYMENT#ID``)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n[len(prefix) :]: n for n in names if n.startswith(prefix)}


def running_count(app_name: str, deployment: str = "PagedKVEngine") -> int:
    from ray import serve

    status = serve.status().applications[app_name].deployments[deployment]
    states = status.replica_states
    return sum(n for state, n in states.items() if getattr(state, "value", state) == "RUNNING")
