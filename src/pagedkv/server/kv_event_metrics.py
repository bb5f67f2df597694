"""The KV event publisher's series for ``/metrics`` (``kvstore/event_publisher.py``). Zeros
without ``--kv-events``, so dashboards need no special case."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

# (name, help, PublisherCounts field)
_COUNTERS = (
    (
        "kv_events_published",
        "KV events (stored / removed / cleared) Redis acknowledged",
        "events_published",
    ),
    (
        "kv_event_batches",
        "KV event batches (one per engine step that changed the prefix cache) Redis acknowledged",
        "batches_published",
    ),
    (
        "kv_events_dropped",
        "KV events not published: Redis down or slow, or the queue full "
        "(a snapshot follows once it answers)",
        "events_dropped",
    ),
    (
        "kv_event_publish_errors",
        "failed XADD round trips and failed pings while Redis was down",
        "publish_errors",
    ),
    (
        "kv_event_snapshots",
        "snapshot batches published (after an outage, or periodically)",
        "snapshots_published",
    ),
    (
        "kv_event_stream_resets",
        "times the stream was deleted and started again with a snapshot "
        "because Redis refused appends to it for good (another writer spoiled it)",
        "stream_resets",
    ),
)


class KVEventCollector(Collector):
    """Reads the publisher's counters at scrape time (``counts``: None without events)."""

    def __init__(self, prefix: str, counts: Callable[[], dict[str, int]] | None) -> None:
        self._prefix, self._counts = prefix, counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts() if self._counts is not None else {}
        for name, help_text, field in _COUNTERS:
            value = counts.get(field, 0)
            yield CounterMetricFamily(f"{self._prefix}_{name}", help_text, value=value)
