"""The lower KV tiers' series for ``/metrics``: prefix-hit tokens per tier (device, host,
store) and the blocks and bytes each tier moved (``kvcache/tiers/counts.py``), by kind."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from pagedkv.engine.stats import EngineSnapshot
from pagedkv.kvcache.tiers.contract import TIER_DEVICE, TIER_HOST, TIER_STORE
from pagedkv.kvcache.tiers.counts import KINDS

TIERS = (TIER_DEVICE, TIER_HOST, TIER_STORE)


def tier_metrics(prefix: str, engine: EngineSnapshot) -> Iterator[Metric]:
    """Counters with a ``tier`` label (and ``kind``: offloaded, loaded, saved); every tier is
    exported, with zeros where it is not configured, so dashboards need no special case."""
    hits = dict(engine.tier_hit_tokens) or {TIER_DEVICE: engine.prefix_hit_tokens}
    family = CounterMetricFamily(
        f"{prefix}_prefix_hit_tokens_by_tier",
        "prompt tokens whose KV was reused, by the tier that held it (device pool, host tier, "
        "shared store)",
        labels=["tier"],
    )
    for tier in TIERS:
        family.add_metric([tier], hits.get(tier, 0))
    yield family
    moves = engine.tier_moves
    for unit, help_text in (("blocks", "KV blocks"), ("bytes", "KV bytes")):
        family = CounterMetricFamily(
            f"{prefix}_kv_tier_{unit}",
            f"{help_text} copied by the lower tiers: offloaded (evicted device -> tier), loaded "
            "(tier -> device, a hit) and saved (write-through of computed blocks)",
            labels=["tier", "kind"],
        )
        counts = getattr(moves, unit) if moves is not None else {}
        for tier in TIERS[1:]:
            for kind in KINDS:
                family.add_metric([tier, kind], counts.get((tier, kind), 0))
        yield family
