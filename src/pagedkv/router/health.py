"""The health loop: every ``interval_s`` each replica is asked ``/pagedkv/info``, ``/health``
and ``/metrics``.

* Unreachable, or ``/health`` not 200: taken out (``up`` False) until a check passes again. A
  request that fails on a replica takes it out at once (``forward.py``); this loop brings it
  back.
* A new ``instance_id`` (the replica restarted): its index entries are dropped and its new KV
  event stream is read from the start. If it came back with another page format, block size,
  hash, model or context than the replica the router started with, it is kept out for as long
  as that instance lives (logged once, counted in ``pagedkv_router_replica_refused_total``,
  ``replica_up`` 0); a later restart with the right format is taken back.
* Its load: ``pagedkv_requests_in_flight + pagedkv_requests_queued`` from its ``/metrics``.

A replica is a peer: its answers are read up to a bound (``MAX_INFO_BYTES``,
``MAX_METRICS_BYTES``) and parsed with limits (``untrusted.py``); a bad answer takes it out with
the reason, never ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

import httpx

from pagedkv import untrusted as u
from pagedkv.router.handshake import (
    INFO_PATH,
    MAX_INFO_BYTES,
    ReplicaInfo,
    first_difference,
    parse_info,
)
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.replicas import IndexFeed, ReplicaState

log = logging.getLogger("pagedkv.router")

LOAD_METRICS = ("pagedkv_requests_in_flight", "pagedkv_requests_queued")


MAX_SCRAPED_REQUESTS = 10**9  # beyond this a replica's count is not a count
MAX_METRICS_BYTES = 4 << 20  # a replica's whole /metrics (ours: ~20 KB); past it: no load read


def scraped_requests(metrics_text: str) -> int:
    """Requests in flight + queued at a replica, from its Prometheus text (0 if absent). A
    replica is a peer: a value that is not a finite count in [0, 1e9] (``NaN``, ``1e400``,
    ``-3``, text) counts as 0 instead of raising."""
    total = 0
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in LOAD_METRICS:
            try:
                number = u.as_float(float(value), name, lo=0, hi=MAX_SCRAPED_REQUESTS)
            except ValueError:  # not a number, or NaN, an infinity, out of range
                continue
            total += int(number)
    return min(total, MAX_SCRAPED_REQUESTS)


class HealthMonitor:
    """Owns the replicas' ``up``, ``info``, ``refused`` and ``scraped_requests``; runs on the
    router's event loop. ``reference``: the info every replica must agree with."""

    def __init__(
        self,
        replicas: Sequence[ReplicaState],
        feed: IndexFeed,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        *,
        reference: ReplicaInfo,
        interval_s: float,
        kv_events_url: str | None = None,
        read_events: bool = True,
    ) -> None:
        """``read_events``: follow the replicas' KV event streams (the policy reads the
        index); ``kv_events_url`` overrides the Redis URL the replicas name."""
        self.replicas, self.feed, self.metrics, self.client = replicas, feed, metrics, client
        # Named so in messages: "block_size 32 (http://b) vs 16 (the router's format)".
        self.reference = replace(reference, url="the router's format")
        self.interval_s, self.kv_events_url = interval_s, kv_events_url
        self.read_events = read_events
        self.timeout_s = max(5.0, 2 * interval_s)

    def follow_events(self, replica: ReplicaState) -> object:
        """Start reading ``replica``'s event stream (none: forget it); returns the old reader."""
        events = replica.info.kv_events
        if not self.read_events:
            return None
        if events is None:
            log.warning(
                "replica %s publishes no KV events (start it with --kv-events): the "
                "router cannot see its prefix cache",
                replica.url,
            )
            return self.feed.forget(replica.url)
        url = self.kv_events_url or events["url"]
        try:
            return self.feed.follow(replica.url, url, events["stream"])
        except Exception as exc:  # noqa: BLE001 - e.g. a URL redis-py cannot parse: route on
            log.error(
                "cannot read replica %s's KV events at %s (%s): the router cannot see "
                "its prefix cache",
                replica.url,
                url,
                exc,
            )
            return self.feed.forget(replica.url)

    async def run(self) -> None:
        """Check every replica each ``interval_s``, for as long as the router runs: nothing a
        replica answers ends the loop (a check that raises anyway is logged and the loop goes
        on), or a replica taken out could never come back."""
        while True:
            await asyncio.sleep(self.interval_s)
            results = await asyncio.gather(
                *(self.check(r) for r in self.replicas), return_exceptions=True
            )
            for r, result in zip(self.replicas, results, strict=True):
                if isinstance(result, Exception):
                    log.error("the health check of %s failed: %r", r.url, result)
                    self.take_out(r, f"the health check failed: {type(result).__name__}")

    async def check(self, r: ReplicaState) -> None:
        try:
            status, body = await self._get(r.url + INFO_PATH, MAX_INFO_BYTES)
            if status != 200:
                raise ValueError(f"{INFO_PATH} answered {status}")
            info = parse_info(r.url, body)  # UntrustedInput: a ValueError naming the field
            health, _ = await self._get(r.url + "/health", 64 << 10)  # read: keeps the connection
            scrape, text = await self._get(r.url + "/metrics", MAX_METRICS_BYTES)
        except (httpx.HTTPError, ValueError) as exc:
            self.take_out(r, f"{type(exc).__name__}: {exc}"[:300])
            return
        if info.instance_id != r.info.instance_id:
            await self._restarted(r, info)
        if r.refused is not None:
            return
        if scrape == 200 and len(text) <= MAX_METRICS_BYTES:
            r.scraped_requests = scraped_requests(text.decode("utf-8", "replace"))
        if health != 200:
            self.take_out(r, f"/health answered {health}")
        elif not r.up:
            log.warning("replica %s is back", r.url)
            r.up = True

    async def _get(self, url: str, max_bytes: int) -> tuple[int, bytes]:
        """The status and at most ``max_bytes + 1`` bytes of the body (more than
        ``max_bytes``: over the bound; the rest is never read)."""
        async with self.client.stream("GET", url, timeout=self.timeout_s) as resp:
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    break
            return resp.status_code, bytes(body[: max_bytes + 1])

    def take_out(self, r: ReplicaState, why: str) -> None:
        if r.up:
            log.warning("replica %s taken out: %s", r.url, why)
        r.up = False
        r.scraped_requests = 0

    async def _restarted(self, r: ReplicaState, info: ReplicaInfo) -> None:
        r.info = info
        diff = first_difference(info, self.reference)
        if diff is not None:
            log.error("replica %s restarted with another format and is kept out: %s", r.url, diff)
            r.refused = diff
            self.metrics.count_refused(r.url)
            old = self.feed.forget(r.url)
        else:
            if r.refused is not None:
                log.warning("replica %s restarted with the router's format again", r.url)
            r.refused = None
            r.num_restarts += 1
            log.warning(
                "replica %s restarted (instance %s): its index entries are dropped",
                r.url,
                info.instance_id,
            )
            old = self.follow_events(r)
        if old is not None:
            await asyncio.to_thread(old.stop)  # type: ignore[attr-defined]
