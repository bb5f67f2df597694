"""``merge_metrics``: replicas' /metrics pages as one, each sample labelled by replica."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedkv.serve_ray.metrics_merge import merge_metrics

PAGE = """# HELP pagedkv_requests requests
# TYPE pagedkv_requests counter
pagedkv_requests_total{outcome="finished"} {n}
# HELP pagedkv_kv_blocks_free free blocks
# TYPE pagedkv_kv_blocks_free gauge
pagedkv_kv_blocks_free {free}
"""


def _samples(text: bytes) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }


def test_each_sample_keeps_its_value_under_its_replica():
    pages = {
        "r1": PAGE.replace("{n}", "3").replace("{free}", "10"),
        "r2": PAGE.replace("{n}", "5").replace("{free}", "7"),
    }
    got = _samples(merge_metrics(pages))
    assert got[("pagedkv_requests_total", (("outcome", "finished"), ("replica", "r1")))] == 3
    assert got[("pagedkv_requests_total", (("outcome", "finished"), ("replica", "r2")))] == 5
    assert got[("pagedkv_kv_blocks_free", (("replica", "r2"),))] == 7
    assert got[("pagedkv_serve_ray_metrics_unreadable", ())] == 0


def test_a_page_that_does_not_parse_is_left_out_and_counted():
    pages = {"r1": PAGE.replace("{n}", "3").replace("{free}", "1"), "r2": "garbage{{{ 1 2 3"}
    got = _samples(merge_metrics(pages))
    assert got[("pagedkv_serve_ray_metrics_unreadable", ())] == 1
    assert not any(dict(labels).get("replica") == "r2" for _, labels in got)
