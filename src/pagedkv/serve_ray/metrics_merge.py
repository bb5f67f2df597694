"""``merge_metrics``: the replicas' ``/metrics`` pages as one Prometheus page, every sample
labelled with its ``replica`` (a scrape of the ingress sees each engine, as a scrape of one
``pagedkv serve`` sees its engine; Prometheus sums across replicas itself)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

REPLICA_LABEL = "replica"


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(pages: Mapping[str, str]) -> bytes:
    """``pages``: replica -> its ``/metrics`` text. A page that does not parse is left out
    (its replica is counted in ``pagedkv_serve_ray_metrics_unreadable``)."""
    merged: dict[str, Metric] = {}
    unreadable = 0
    for replica, text in sorted(pages.items()):
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            unreadable += 1
            continue
        for fam in families:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                labels = {**s.labels, REPLICA_LABEL: replica}
                out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
    gauge = Metric(
        "pagedkv_serve_ray_metrics_unreadable",
        "replicas whose /metrics did not parse in this scrape",
        "gauge",
    )
    gauge.add_sample(gauge.name, {}, float(unreadable))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*merged.values(), gauge]))
    return generate_latest(registry)
