"""The shared store's series for ``/metrics`` (``kvstore/counters.py``). Hit tokens from the
store are ``prefix_hit_tokens_by_tier{tier="store"}`` (``tier_metrics.py``); here: the bytes
that crossed the network, blocks written or dropped, store errors and rejected payloads by
reason. Zeros without a store, so dashboards need no special case."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from pagedkv.engine.stats import EngineSnapshot
from pagedkv.kvstore.codec import REJECT_REASONS

_PLAIN = (
    (
        "kv_store_blocks_written",
        "full KV blocks the shared store acknowledged (write-through)",
        "blocks_written",
    ),
    (
        "kv_store_writes_dropped",
        "KV blocks not written: store down, or the write queue full",
        "writes_dropped",
    ),
    (
        "kv_store_errors",
        "shared-store operations that failed (refused, timed out); each is a "
        "miss or a dropped write, never an engine error",
        "errors",
    ),
)


def store_metrics(prefix: str, engine: EngineSnapshot) -> Iterator[Metric]:
    counts = dict(engine.kv_store)
    family = CounterMetricFamily(
        f"{prefix}_kv_store_bytes",
        "payload bytes read from / written to the shared KV store",
        labels=["direction"],
    )
    family.add_metric(["read"], counts.get("bytes_read", 0))
    family.add_metric(["written"], counts.get("bytes_written", 0))
    yield family
    for name, help_text, key in _PLAIN:
        yield CounterMetricFamily(f"{prefix}_{name}", help_text, value=counts.get(key, 0))
    family = CounterMetricFamily(
        f"{prefix}_kv_store_rejected_payloads",
        "store payloads refused (and their blocks recomputed), by reason: truncated, bad_magic, "
        "bad_version, foreign_format, wrong_hash, bad_length, bad_checksum",
        labels=["reason"],
    )
    for reason in REJECT_REASONS:
        family.add_metric([reason], counts.get(f"rejected_{reason}", 0))
    yield family
