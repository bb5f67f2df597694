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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

import httpx

from pagedkv.router.handshake import INFO_PATH, ReplicaInfo, first_difference
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.replicas import IndexFeed, ReplicaState

log = logging.getLogger("pagedkv.router")

LOAD_METRICS = ("pagedkv_requests_in_flight", "pagedkv_requests_queued")


MAX_SCRAPED_REQUESTS = 10**9  # beyond this a replica's count is not a count


def scraped_requests(metrics_text: str) -> int:
    """Requests in flight + queued at a replica, from its Prometheus text (0 if absent). A
    replica is a peer: a value that is not a finite count in [0, 1e9] (``NaN``, ``1e400``,
    ``-3``, text) counts as 0 instead of raising."""
    total = 0
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in LOAD_METRICS:
            try:
                number = float(value)
            except ValueError:
                continue
            if 0 <= number <= MAX_SCRAPED_REQUESTS:  # False for NaN and the infinities
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
            log.warning("replica %s publishes no KV events (start it with --kv-events): the "
                        "router cannot see its prefix cache", replica.url)  # fmt: skip
            return self.feed.forget(replica.url)
        url = self.kv_events_url or events["url"]
        try:
            return self.feed.follow(replica.url, url, events["stream"])
        except Exception as exc:  # noqa: BLE001 - e.g. a URL redis-py cannot parse: route on
            log.error("cannot read replica %s's KV events at %s (%s): the router cannot see "
                      "its prefix cache", replica.url, url, exc)  # fmt: skip
            return self.feed.forget(replica.url)

    async def run(self) -> None:
        """Check every replica each ``interval_s``, for as long as the router runs: nothing a
        replica answers ends the loop (a check that raises anyway is logged and the loop goes
        on), or a replica taken out could never come back."""
        while True:
            await asyncio.sleep(self.interval_s)
            results = await asyncio.gather(*(self.check(r) for r in self.replicas),
                                           return_exceptions=True)  # fmt: skip
            for r, result in zip(self.replicas, results, strict=True):
                if isinstance(result, Exception):
                    log.error("the health check of %s failed: %r", r.url, result)
                    self.take_out(r, f"the health check failed: {type(result).__name__}")

    async def check(self, r: ReplicaState) -> None:
        try:
            resp = await self.client.get(r.url + INFO_PATH, timeout=self.timeout_s)
            resp.raise_for_status()
            info = ReplicaInfo.from_json(r.url, resp.json())
            health = await self.client.get(r.url + "/health", timeout=self.timeout_s)
            scrape = await self.client.get(r.url + "/metrics", timeout=self.timeout_s)
        except (httpx.HTTPError, ValueError) as exc:
            self.take_out(r, f"{type(exc).__name__}: {exc}"[:300])
            return
        except RecursionError:  # JSON nested 100k deep: no replica of ours sends that
            self.take_out(r, "a malformed /pagedkv/info (nested too deep)")
            return
        if info.instance_id != r.info.instance_id:
            await self._restarted(r, info)
        if r.refused is not None:
            return
        if scrape.status_code == 200:
            r.scraped_requests = scraped_requests(scrape.text)
        if health.status_code != 200:
            self.take_out(r, f"/health answered {health.status_code}")
        elif not r.up:
            log.warning("replica %s is back", r.url)
            r.up = True

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
            log.warning("replica %s restarted (instance %s): its index entries are dropped",
                        r.url, info.instance_id)  # fmt: skip
            old = self.follow_events(r)
        if old is not None:
            await asyncio.to_thread(old.stop)  # type: ignore[attr-defined]
