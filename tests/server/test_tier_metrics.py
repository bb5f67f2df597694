"""The lower tiers' /metrics series (``server/tier_metrics.py``): hit tokens by tier, and the
blocks and bytes each tier moved, zeros where a tier is not configured."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from pagedkv.kvcache.tiers.counts import TierCounts
from pagedkv.server.tier_metrics import tier_metrics


class _Fixed(Collector):
    def __init__(self, snapshot) -> None:
        self.snapshot = snapshot

    def collect(self):
        return tier_metrics("pagedkv", self.snapshot)


def render(snapshot) -> str:
    registry = CollectorRegistry()
    registry.register(_Fixed(snapshot))
    return generate_latest(registry).decode()


def test_without_lower_tiers_every_hit_is_a_device_hit() -> None:
    text = render(SimpleNamespace(tier_hit_tokens=(), prefix_hit_tokens=48, tier_moves=None))
    assert 'pagedkv_prefix_hit_tokens_by_tier_total{tier="device"} 48.0' in text
    assert 'pagedkv_prefix_hit_tokens_by_tier_total{tier="host"} 0.0' in text
    assert 'pagedkv_kv_tier_blocks_total{kind="loaded",tier="host"} 0.0' in text


def test_hits_blocks_and_bytes_per_tier() -> None:
    moves = TierCounts()
    moves.add("host", "offloaded", 5, 1024)
    moves.add("host", "loaded", 3, 1024)
    moves.add("store", "saved", 2, 1024)
    snap = SimpleNamespace(
        tier_hit_tokens=(("device", 32), ("host", 48)), prefix_hit_tokens=80, tier_moves=moves
    )
    text = render(snap)
    assert 'pagedkv_prefix_hit_tokens_by_tier_total{tier="device"} 32.0' in text
    assert 'pagedkv_prefix_hit_tokens_by_tier_total{tier="host"} 48.0' in text
    assert 'pagedkv_prefix_hit_tokens_by_tier_total{tier="store"} 0.0' in text
    assert 'pagedkv_kv_tier_blocks_total{kind="offloaded",tier="host"} 5.0' in text
    assert 'pagedkv_kv_tier_bytes_total{kind="loaded",tier="host"} 3072.0' in text
    assert 'pagedkv_kv_tier_bytes_total{kind="saved",tier="store"} 2048.0' in text
