"""Routing stats (``serve_ray/stats.py``): what a replica reports and what a router accepts."""

from __future__ import annotations

import hashlib

import pytest

from pagedkv.kvcache.events import replay
from pagedkv.routing import PrefixIndex
from pagedkv.serve_ray.stats import SCHEMA, StatsMaker, parse_stats
from pagedkv.untrusted import UntrustedInput


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_epoch_changes_only_when_the_set_does():
    maker = StatsMaker("inst", block_size=16)
    a = maker.make(0, [_h(1), _h(2)])
    b = maker.make(3, [_h(2), _h(1)])  # same set, other order and load
    c = maker.make(3, [_h(2)])
    assert a.epoch == b.epoch == 1 and c.epoch == 2
    assert a.to_dict()["block_hashes"] == b.to_dict()["block_hashes"]  # an unchanged dict
    assert b.num_requests == 3


def test_snapshot_replays_to_exactly_the_held_set():
    held = {_h(i) for i in range(10)}
    stats = StatsMaker("inst", 16).make(0, held)
    got = {_h(99)}  # something stale the snapshot must clear
    replay(stats.snapshot_events(), got)
    assert got == held
    empty = StatsMaker("inst", 16).make(0, [])
    got = {_h(1)}
    replay(empty.snapshot_events(), got)
    assert got == set()


def test_cap_truncates_and_says_so():
    stats = StatsMaker("inst", 16, max_blocks=3).make(0, [_h(i) for i in range(5)])
    assert len(stats.block_hashes) == 3 and stats.truncated
    assert not StatsMaker("inst", 16, max_blocks=5).make(0, [_h(i) for i in range(5)]).truncated


def test_round_trip_through_a_dict():
    stats = StatsMaker("inst", 16).make(2, [_h(1)])
    assert parse_stats(stats.to_dict()) == stats
    assert parse_stats({}) is None  # not polled yet


@pytest.mark.parametrize(
    "change",
    [
        {"schema": "other/9"},
        {"block_hashes": ["not bytes"]},
        {"block_hashes": [b""]},
        {"block_hashes": [b"x" * 65]},
        {"block_hashes": [b"x"] * 70_000},
        {"num_requests": -1},
        {"num_requests": 1e400},
        {"instance_id": "x" * 1000},
        {"block_size": 0},
        {"epoch": "1"},
        {"truncated": "no"},
    ],
)
def test_hostile_stats_are_refused_naming_the_field(change):
    good = StatsMaker("inst", 16).make(0, [_h(1)]).to_dict()
    with pytest.raises(UntrustedInput):
        parse_stats({**good, **change})
    with pytest.raises(UntrustedInput):
        parse_stats([1, 2, 3])


def test_the_schema_is_versioned():
    assert StatsMaker("i", 16).make(0, []).to_dict()["schema"] == SCHEMA


def test_an_index_fed_snapshots_matches_prefixes():
    index = PrefixIndex()
    chain = [_h(i) for i in range(4)]
    index.apply("a", StatsMaker("ia", 16).make(0, chain[:3]).snapshot_events())
    index.apply("b", StatsMaker("ib", 16).make(0, chain[:1]).snapshot_events())
    assert index.match(chain) == {"a": 3, "b": 1}
