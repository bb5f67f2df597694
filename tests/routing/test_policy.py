"""Routing policies on hand-built loads and matches."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedkv.errors import UsageError
from pagedkv.routing import ROUTING_POLICIES, ReplicaLoad, build_policy


def _loads(*counts: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", n) for i, n in enumerate(counts)]


def test_round_robin_takes_turns_whatever_the_load_and_cache():
    p = build_policy("round-robin")
    picks = [p.choose(_loads(0, 50, 9), {"r1": 10}).replica for _ in range(6)]
    assert Counter(picks) == {"r0": 2, "r1": 2, "r2": 2}
    assert picks[:3] != picks[1:4]  # in turn, not the same one


def test_least_loaded_picks_the_minimum_and_shares_ties():
    p = build_policy("least-loaded")
    assert {p.choose(_loads(3, 1, 2), {"r0": 9}).replica for _ in range(5)} == {"r1"}
    tied = Counter(p.choose(_loads(1, 5, 1), {}).replica for _ in range(10))
    assert tied == {"r0": 5, "r2": 5}


def test_prefix_aware_prefers_the_longest_hit_within_the_band():
    p = build_policy("prefix-aware", balance_abs=2, balance_rel=0.0)
    d = p.choose(_loads(2, 0, 1), {"r0": 5, "r2": 3})
    assert (d.replica, d.reason, d.matched_blocks) == ("r0", "prefix", 5)  # 2 <= 0 + 2
    d = p.choose(_loads(3, 0, 1), {"r0": 5, "r2": 3})  # r0 is out of the band now
    assert (d.replica, d.reason, d.matched_blocks) == ("r2", "balance", 3)
    d = p.choose(_loads(3, 0, 1), {"r0": 5})
    assert (d.replica, d.reason, d.matched_blocks) == ("r1", "balance", 0)
    d = p.choose(_loads(4, 2, 2), {})
    assert d.reason == "no-prefix" and d.replica in {"r1", "r2"}


def test_prefix_aware_band_grows_with_load():
    p = build_policy("prefix-aware", balance_abs=1, balance_rel=0.5)
    # The least loaded has 10: the band is 10 + max(1, 5) = 15.
    assert p.choose(_loads(15, 10), {"r0": 1}).replica == "r0"
    assert p.choose(_loads(16, 10), {"r0": 1}).replica == "r1"


def test_one_hot_prefix_spreads_once_its_holder_is_ahead():
    """Every request shares one prefix that only r0 holds at first. Requests never finish, so
    load only grows: the holder takes requests until it is balance_abs ahead, then the others
    get them; none ends more than balance_abs + 1 above the least loaded."""
    p = build_policy("prefix-aware", balance_abs=3, balance_rel=0.0)
    load = {"r0": 0, "r1": 0, "r2": 0}
    holders = {"r0"}
    for _ in range(60):
        d = p.choose([ReplicaLoad(n, c) for n, c in load.items()], {h: 4 for h in holders})
        load[d.replica] += 1
        holders.add(d.replica)  # it computed the prefix: now it holds it too
    assert max(load.values()) - min(load.values()) <= 4
    assert load["r0"] >= max(load["r1"], load["r2"])


def test_bad_names_and_parameters_are_usage_errors():
    assert ROUTING_POLICIES == ("round-robin", "least-loaded", "prefix-aware")
    with pytest.raises(UsageError, match="choose one of round-robin"):
        build_policy("random")
    with pytest.raises(UsageError, match="balance_abs"):
        build_policy("prefix-aware", balance_abs=-1)
    with pytest.raises(UsageError, match="balance_rel"):
        build_policy("prefix-aware", balance_rel=float("nan"))
