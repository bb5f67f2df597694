"""Prometheus metrics of one server: the KV pool and scheduler (read from the engine loop's
latest snapshot when scraped), time to first token, request outcomes, and the page format.

Each server has its own ``CollectorRegistry`` (not the process-global one), so that several
servers in one process -- tests, benchmarks -- never share or collide on series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.server.engine_loop import LoopSnapshot
from pagedkv.server.store_metrics import store_metrics
from pagedkv.server.tier_metrics import tier_metrics

PREFIX = "pagedkv"

# Seconds; CPU prefill of a long prompt behind a full batch can take several seconds.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# (name, help, field) of the gauges and counters read from the engine's snapshot; the loop's
# own counts follow in ``_LOOP_GAUGES``.
_GAUGES = (
    ("kv_blocks_total", "KV blocks in the pool", "num_total_blocks"),
    ("kv_blocks_free", "KV blocks holding nothing reusable", "num_empty_blocks"),
    ("kv_blocks_used", "KV blocks referenced by a live sequence", "num_used_blocks"),
    (
        "kv_blocks_cached",
        "KV blocks held by no sequence but revivable by a prefix hit",
        "num_cached_blocks",
    ),
    ("kv_utilization_ratio", "KV slots storing live tokens / pool slots", "kv_utilization"),
    (
        "sequences_running",
        "sequences in the running batch (an n > 1 request counts n)",
        "num_running_seqs",
    ),
    ("sequences_waiting", "sequences queued for admission (or preempted)", "num_waiting_seqs"),
    (
        "sequences_running_peak",
        "most sequences in one step's batch since start",
        "peak_running_seqs",
    ),
)
_LOOP_GAUGES = (
    (
        "requests_in_flight",
        "requests submitted and not yet finished or aborted",
        "num_requests_in_flight",
    ),
    (
        "requests_queued",
        "requests waiting in the server's fair queue, not yet in the engine",
        "num_requests_queued",
    ),
)
_COUNTERS = (
    (
        "prefix_hit_tokens",
        "prompt tokens whose KV was reused from the prefix cache",
        "prefix_hit_tokens",
    ),
    ("prefix_query_tokens", "prompt tokens looked up in the prefix cache", "prefix_query_tokens"),
    (
        "preemptions",
        "sequences preempted (their KV recomputed later, or swapped out)",
        "num_preemptions",
    ),
    (
        "swap_out_sequences",
        "preempted sequences whose KV was copied to the host swap pool",
        "num_swap_outs",
    ),
    ("swap_in_sequences", "swapped-out sequences copied back to the device pool", "num_swap_ins"),
    (
        "swap_out_blocks",
        "KV blocks copied device -> host by swap preemption",
        "num_swapped_blocks_out",
    ),
    (
        "swap_in_blocks",
        "KV blocks copied host -> device by swap preemption",
        "num_swapped_blocks_in",
    ),
    ("swap_out_bytes", "KV bytes copied device -> host by swap preemption", "swap_out_bytes"),
    ("swap_in_bytes", "KV bytes copied host -> device by swap preemption", "swap_in_bytes"),
    (
        "swap_fallbacks",
        "preempted sequences recomputed because the host swap pool was full",
        "num_swap_fallbacks",
    ),
    ("generated_tokens", "tokens sampled (every sample of every request)", "generated_tokens"),
    ("engine_steps", "engine steps that ran a batch", "num_steps"),
    (
        "failed_requests",
        "requests a failure inside the engine ended (the others went on)",
        "num_failed_requests",
    ),
    (
        "partial_prefix_hits",
        "admissions whose prefix hit ended inside a block (reused in part)",
        "num_partial_hits",
    ),
    (
        "partial_prefix_hit_tokens",
        "of prefix_hit_tokens, those in partially matched blocks",
        "partial_hit_tokens",
    ),
    (
        "prefix_copy_bytes",
        "KV bytes copied from partially matched blocks into fresh ones",
        "prefix_copy_bytes",
    ),
    (
        "partial_prefix_claims",
        "partially matched blocks claimed in place (unused: no copy)",
        "num_partial_claims",
    ),
)


class _SnapshotCollector(Collector):
    """Reads the snapshot at scrape time: no metric is updated on the engine's hot path."""

    def __init__(self, snapshot: Callable[[], LoopSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        engine = snap.engine
        for name, help_text, field in _GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=getattr(engine, field))
        for name, help_text, field in _LOOP_GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=getattr(snap, field))
        for name, help_text, field in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=getattr(engine, field))
        yield from tier_metrics(PREFIX, engine)
        yield from store_metrics(PREFIX, engine)


class ServerMetrics:
    """The registry of one server. ``observe_ttft`` and ``count_request`` are called from the
    HTTP handlers (prometheus-client's metric objects are thread-safe)."""

    def __init__(
        self,
        snapshot: Callable[[], LoopSnapshot],
        page_format: dict[str, str],
        placement: dict[str, str] | None = None,
    ):
        """``page_format``: the page format's labels; ``placement``: device, dtype and
        attention backend (``EngineInfo.placement``), each an info series."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SnapshotCollector(snapshot))
        self._ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "seconds from a request's arrival to its first generated token",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._requests = Counter(
            f"{PREFIX}_requests",
            "requests by outcome: finished, aborted (client left), rejected (4xx), failed (5xx)",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("finished", "aborted", "rejected", "failed"):
            self._requests.labels(outcome)  # export zeros from the start
        info = Info(
            f"{PREFIX}_page_format",
            "the resolved block size, paging policy and KV page-format fingerprint",
            registry=self.registry,
        )
        info.info(page_format)
        if placement is not None:
            Info(
                f"{PREFIX}_engine",
                "where the model runs: device, dtype, attention backend",
                registry=self.registry,
            ).info(placement)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def count_request(self, outcome: str) -> None:
        self._requests.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
