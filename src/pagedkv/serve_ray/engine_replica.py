"""``EngineReplica``: the body of the engine deployment. One replica is one ``LLMEngine`` with
its own KV pool, behind ``pagedkv serve``'s own app, played request by request (``call.py``).

Serve's hooks it answers:

* ``record_routing_stats``: the load and the prefix blocks held (``stats.py``), read on the
  engine thread (``EngineLoop.call``), for ``PagedKVRequestRouter``;
* ``check_health``: raises once the engine loop is gone or failed, so Serve replaces the
  replica (its in-flight requests have already ended with the app's 5xx);
* ``__del__``: the engine loop stops (requests still in it end with 503 ``shutting_down``).

The class is plain; ``app.py`` makes it a deployment with the configured resources and router.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from pagedkv.kvcache.hashing import BlockHash
from pagedkv.serve_ray.call import REPLICA_HEADER, AnswerHead, ReplicaCall, run_asgi
from pagedkv.serve_ray.stats import StatsMaker

log = logging.getLogger("pagedkv.serve_ray")


def held_block_hashes(engine: Any) -> list[BlockHash]:
    """Every hash the engine's prefix cache holds, device and host tier (engine thread)."""
    from pagedkv.engine.kv.events import held_hashes

    return [h for _, hashes in held_hashes(engine.allocator) for h in hashes]


def replica_name() -> str:
    """This Serve replica's id (what ``x-pagedkv-replica`` says and the router ranks)."""
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class EngineReplica:
    """Builds the engine from ``engine_config`` and serves with ``server_config`` (its host
    and port are unused: requests arrive through Serve). ``pd_role``: this side of a P/D
    graph (``pd.py``; ``prefill``: the prefill deployment's handle, on the decode side), or
    None. ``max_stats_blocks``: the cap of each stats snapshot."""

    async def __init__(
        self,
        engine_config: Any,
        server_config: Any,
        max_stats_blocks: int,
        pd_role: Any = None,
        prefill: Any = None,
    ) -> None:
        from pagedkv.engine import LLMEngine
        from pagedkv.server import create_app

        self.name = replica_name()
        engine = await asyncio.to_thread(LLMEngine, engine_config)
        pd = None
        if pd_role is not None:  # the page-format contract is checked here (pd.py)
            pd = await pd_role.front(engine, server_config, prefill)
        prefill_side = pd_role is not None and pd_role.is_prefill
        self.app = create_app(engine, server_config, pd=pd, flush_store=prefill_side)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine loop
        self.loop = self.app.state.engine_loop
        info = self.app.state.replica_info
        self.stats = StatsMaker(info["instance_id"], info["block_size"], max_stats_blocks)
        log.info(
            "engine replica %s (pid %d): instance %s", self.name, os.getpid(), info["instance_id"]
        )

    async def call(self, call: ReplicaCall) -> AsyncIterator[AnswerHead | bytes]:
        """The app's answer to ``call``: its head (with ``x-pagedkv-replica``), then chunks."""
        async for item in run_asgi(self.app, call):
            if isinstance(item, AnswerHead):
                item = AnswerHead(item.status, (*item.headers, (REPLICA_HEADER, self.name)))
            yield item

    def info(self) -> dict[str, Any]:
        """``GET /pagedkv/info``'s body, and this replica's Serve id."""
        return {**self.app.state.replica_info, "replica": self.name}

    async def record_routing_stats(self) -> dict[str, Any]:
        from pagedkv.server.engine_call import EngineCall

        call = EngineCall(held_block_hashes)
        self.loop.call(call)
        held = await asyncio.wrap_future(call.future)
        return self.stats.make(self.loop.snapshot.num_requests_in_flight, held).to_dict()

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError(self.loop.failed or "the engine loop is not running")

    async def __del__(self) -> None:
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            self._lifespan = None
            await lifespan.__aexit__(None, None, None)
