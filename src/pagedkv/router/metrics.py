"""The router's Prometheus metrics: each request once by outcome, each policy decision, the
retries, and per replica its state (read from the replicas' states when scraped).

Outcomes: ``finished``; ``rejected`` (a 4xx, from the router's edge or passed through from a
replica); ``failed`` (a 5xx, a replica that died mid-stream or timed out); ``unavailable`` (no
replica could take it: 503); ``aborted`` (the client left). Requests that never reached a
replica carry ``replica="none"``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.router.replicas import IndexFeed, ReplicaState
from pagedkv.routing import RouteDecision

P = "pagedkv_router"
OUTCOMES = ("finished", "rejected", "failed", "unavailable", "aborted")
NO_REPLICA = "none"
# Seconds the router spends on a request before forwarding it (parse, tokenize, hash, choose).
EDGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _ReplicaCollector(Collector):
    def __init__(self, replicas: Sequence[ReplicaState], feed: IndexFeed) -> None:
        self._replicas, self._feed = replicas, feed

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "replica_up": "1 while the replica is routable (healthy, same page format)",
            "replica_in_flight": "requests the router has open to the replica",
            "replica_load": "the load the policy sees: max(scraped in flight + queued, own)",
            "replica_index_blocks": "blocks the prefix index says the replica's cache holds",
            "kv_events_connected": "1 while the replica's KV event stream is being read",
            "replica_breaker_open": "1 while the replica's circuit breaker is open or half open "
            "(skipped until a probe answers)",
        }
        fams = {k: GaugeMetricFamily(f"{P}_{k}", h, labels=["replica"]) for k, h in gauges.items()}
        batches = CounterMetricFamily(
            f"{P}_kv_event_batches", "KV event batches applied", labels=["replica"]
        )
        restarts = CounterMetricFamily(
            f"{P}_replica_restarts",
            "times the replica came back with a new instance id",
            labels=["replica"],
        )
        counters = {
            "kv_event_malformed": "KV event stream entries skipped: not a batch this version "
            "wrote, or over the caps (size, nesting, numbers, hashes)",
            "kv_event_stream_resets": "times the replica's KV event stream was found reset "
            "and read again from its start",
            "index_evicted_blocks": "prefix index entries of the replica dropped by the "
            "index's memory bound (largest replica first)",
            "replica_breaker_opens": "times the replica's circuit breaker opened",
            "replica_breaker_short_circuits": "requests that skipped the replica because its "
            "circuit breaker was open",
        }
        more = {
            k: CounterMetricFamily(f"{P}_{k}", h, labels=["replica"]) for k, h in counters.items()
        }
        for r in self._replicas:
            reader = self._feed.reader(r.url)
            fams["replica_up"].add_metric([r.url], float(r.routable))
            fams["replica_in_flight"].add_metric([r.url], r.in_flight)
            fams["replica_load"].add_metric([r.url], r.load)
            fams["replica_index_blocks"].add_metric([r.url], self._feed.num_blocks(r.url))
            connected = bool(getattr(reader, "connected", False))
            fams["kv_events_connected"].add_metric([r.url], float(connected))
            batches.add_metric([r.url], getattr(reader, "num_batches", 0))
            restarts.add_metric([r.url], r.num_restarts)
            more["kv_event_malformed"].add_metric([r.url], getattr(reader, "num_malformed", 0))
            more["kv_event_stream_resets"].add_metric([r.url], getattr(reader, "num_resets", 0))
            more["index_evicted_blocks"].add_metric([r.url], self._feed.num_evicted(r.url))
            breaker = r.breaker.counts()
            fams["replica_breaker_open"].add_metric([r.url], float(r.breaker.state != "closed"))
            more["replica_breaker_opens"].add_metric([r.url], breaker.num_opens)
            more["replica_breaker_short_circuits"].add_metric([r.url], breaker.num_short_circuits)
        yield from fams.values()
        yield batches
        yield restarts
        yield from more.values()


class RouterMetrics:
    """One registry per router (never the process-global one: tests run several)."""

    def __init__(self, replicas: Sequence[ReplicaState], feed: IndexFeed, policy: str) -> None:
        self.policy = policy
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_ReplicaCollector(replicas, feed))
        r = self.registry
        self._requests = Counter(
            f"{P}_requests",
            "requests, each counted once when it ends",
            ["replica", "policy", "outcome"],
            registry=r,
        )
        self._decisions = Counter(
            f"{P}_decisions",
            "policy decisions (a retry decides again)",
            ["policy", "reason"],
            registry=r,
        )
        self._retries = Counter(
            f"{P}_retries",
            "requests sent to another replica after this one failed before answering",
            ["replica"],
            registry=r,
        )
        self._predicted = Counter(
            f"{P}_predicted_hit_blocks",
            "request blocks the index said the chosen replica holds",
            ["replica"],
            registry=r,
        )
        self._blocks = Counter(
            f"{P}_request_blocks", "full prompt blocks of routed requests", registry=r
        )
        self._refused = Counter(
            f"{P}_replica_refused",
            "times a replica came back with another page format or model and was kept out",
            ["replica"],
            registry=r,
        )
        self._edge = Histogram(
            f"{P}_edge_seconds",
            "seconds from a request's arrival to forwarding it (parse, tokenize, hash, choose)",
            buckets=EDGE_BUCKETS_S,
            registry=r,
        )
        for rep in [*(x.url for x in replicas), NO_REPLICA]:
            for outcome in OUTCOMES:
                self._requests.labels(rep, policy, outcome)  # export zeros from the start

    def count_request(self, replica: str, outcome: str) -> None:
        self._requests.labels(replica, self.policy, outcome).inc()

    def count_decision(self, decision: RouteDecision, num_blocks: int) -> None:
        self._decisions.labels(decision.policy, decision.reason).inc()
        self._predicted.labels(decision.replica).inc(decision.matched_blocks)
        self._blocks.inc(num_blocks)

    def count_retry(self, failed_replica: str) -> None:
        self._retries.labels(failed_replica).inc()

    def count_refused(self, replica: str) -> None:
        self._refused.labels(replica).inc()

    def observe_edge(self, seconds: float) -> None:
        self._edge.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
