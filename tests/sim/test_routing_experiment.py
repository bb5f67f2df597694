"""`pagedkv experiment routing`: the grid, the point's configuration, a quick smoke run."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.errors import UsageError
from pagedkv.sim.experiments import routing


def test_the_grid_is_every_router_at_every_replica_count_with_the_rate_scaled() -> None:
    pts = routing.points(quick=False, trace="t.jsonl")
    assert len(pts) == 6 * 3 and pts[0].num_replicas == 64  # the slowest start first
    assert {(p.num_replicas, p.router) for p in pts} == {
        (n, r) for n in (2, 4, 8, 16, 32, 64) for r in routing.ROUTERS
    }
    assert all(p.rate_scale == p.num_replicas / 2 and p.max_requests is None for p in pts)
    quick = routing.points(quick=True, trace="t.jsonl")
    assert {p.num_replicas for p in quick} == {2, 4, 8}
    assert {p.max_requests for p in quick} == {routing.QUICK_NUM_REQUESTS}


def test_a_point_is_a_simulate_configuration() -> None:
    cfg = routing.config_for(routing.Point(16, "prefix-aware", 8.0, None, "t.jsonl"))
    assert (cfg.num_replicas, cfg.routers, cfg.rate_scale) == (16, ("prefix-aware",), 8.0)
    assert (cfg.model, cfg.gpu, cfg.policies) == ("llama-3-8b", "H100-80GB", ("vllm",))


def test_a_missing_trace_is_one_usage_error(monkeypatch) -> None:
    monkeypatch.setattr(routing, "TRACE_NAME", "no_such_trace.jsonl")
    with pytest.raises(UsageError, match="no_such_trace.jsonl: not found"):
        routing.find_trace()


def test_quick_run_writes_the_json_and_the_figure(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("matplotlib")
    try:
        routing.find_trace()
    except UsageError:
        pytest.skip("the shared Mooncake trace is not here")
    monkeypatch.setattr(routing, "QUICK_REPLICAS", (2, 4))
    monkeypatch.setattr(routing, "QUICK_NUM_REQUESTS", 40)
    argv = ["experiment", "routing", "--quick", "--workers", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "experiments" / "routing.json").read_text())
    rows = result["points"]
    assert [(r["num_replicas"], r["router"]) for r in rows] == [
        (n, r) for n in (2, 4) for r in routing.ROUTERS
    ]
    for r in rows:
        assert r["num_requests"] == 40 and len(r["replicas"]) == r["num_replicas"]
        assert 0 < r["prefix_hit_tokens"] <= r["ideal_prefix_hit_tokens"]
    assert (tmp_path / "img" / "routing.png").read_bytes()[:4] == b"\x89PNG"
