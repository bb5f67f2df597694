"""``Ranker``: Serve's tiers from pagedkv's routing policy, hand-computed cases."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.routing import PrefixAware, ReplicaLoad
from pagedkv.serve_ray.ranking import Ranker
from pagedkv.serve_ray.stats import StatsMaker


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


CHAIN = [_h(i) for i in range(4)]  # a prompt of 4 full blocks


def _stats(instance: str, held, load: int = 0) -> dict:
    return StatsMaker(instance, 16).make(load, held).to_dict()


def test_the_prefix_holder_is_the_first_tier():
    r = Ranker()
    tiers, d = r.rank([("a", _stats("ia", [])), ("b", _stats("ib", CHAIN[:3]))], CHAIN)
    assert tiers == [["b"], ["a"]] and d.reason == "prefix" and d.matched_blocks == 3


def test_no_hashes_or_no_holder_goes_to_the_least_loaded():
    r = Ranker(hint_ttl_s=0)
    cands = [("a", _stats("ia", CHAIN, load=3)), ("b", _stats("ib", [], load=1))]
    tiers, d = r.rank(cands, [])
    assert tiers[0] == ["b"] and d.reason == "no-prefix"
    tiers, d = r.rank(cands, [_h(100)])
    assert tiers[0] == ["b"] and d.reason == "no-prefix"


def test_a_loaded_holder_loses_to_the_least_loaded():
    """balance_abs 4: the holder at 5 is outside 0 + 4, so load wins (reason ``balance``)."""
    r = Ranker(balance_abs=4, hint_ttl_s=0)
    tiers, d = r.rank([("a", _stats("ia", CHAIN, load=5)), ("b", _stats("ib", []))], CHAIN)
    assert tiers == [["b"], ["a"]] and d.reason == "balance"
    tiers, d = r.rank([("a", _stats("ia", CHAIN, load=4)), ("b", _stats("ib", []))], CHAIN)
    assert tiers[0] == ["a"] and d.reason == "prefix"  # at the band's edge: still the holder


def test_requests_sent_here_count_at_once_until_they_complete():
    r = Ranker(balance_abs=1, hint_ttl_s=0)
    cands = [("a", _stats("ia", CHAIN)), ("b", _stats("ib", []))]
    r.sent("a")
    assert r.rank(cands, CHAIN)[0][0] == ["a"]  # a: 1, within 0 + 1
    r.sent("a")
    assert r.rank(cands, CHAIN)[0][0] == ["b"]  # a: 2, outside
    r.completed("a")
    r.completed("b")  # never below zero
    assert (r.in_flight["a"], r.in_flight["b"]) == (1, 0)
    assert r.rank(cands, CHAIN)[0][0] == ["a"]


def test_the_poll_s_load_counts_when_it_is_the_larger():
    r = Ranker(balance_abs=1, hint_ttl_s=0)
    r.sent("a")
    r.observe("a", _stats("ia", CHAIN, load=3))  # other routers' requests there too
    assert r.load("a") == 3
    r.observe("a", _stats("ia", CHAIN, load=0))
    assert r.load("a") == 1


def test_bad_stats_count_as_none_and_never_raise():
    r = Ranker()
    cands = [("a", {"schema": "junk"}), ("b", _stats("ib", CHAIN[:1])), ("c", [1, 2])]
    tiers, d = r.rank(cands, CHAIN)
    assert tiers[0] == ["b"] and r.bad_stats["a"] == 1 and r.bad_stats["c"] == 1


def test_entries_are_rebuilt_only_when_the_replica_says_its_cache_changed():
    r = Ranker()
    first = _stats("ia", CHAIN[:2])
    r.observe("a", first)
    events = r.index.num_events
    r.observe("a", first)  # the same (instance, epoch): nothing re-applied
    assert r.index.num_events == events
    r.observe("a", _stats("ia2", CHAIN[:1]))  # a restarted engine: a new instance
    assert r.index.match(CHAIN) == {"a": 1}
    r.forget("a")
    assert r.index.match(CHAIN) == {} and r.load("a") == 0


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    held=st.lists(st.integers(0, 4), min_size=5, max_size=5),
)
def test_decisions_are_the_routing_policy_s(loads, held):
    """The ranker asks ``pagedkv.routing.PrefixAware`` itself: fed the same loads and matches,
    a fresh policy (the one ``pagedkv route`` builds) picks the same replica for the same
    reason, and the tiers hold every candidate once."""
    names = [f"r{i}" for i in range(len(loads))]
    cands = [(n, _stats(f"i{n}", CHAIN[: held[i]], loads[i])) for i, n in enumerate(names)]
    tiers, d = Ranker(balance_abs=2, hint_ttl_s=0).rank(cands, CHAIN)
    matched = {n: held[i] for i, n in enumerate(names) if held[i]}
    ref = PrefixAware(balance_abs=2).choose(
        [ReplicaLoad(n, loads[i]) for i, n in enumerate(names)], matched
    )
    assert (d.replica, d.reason, d.matched_blocks) == (ref.replica, ref.reason, ref.matched_blocks)
    assert sorted(n for t in tiers for n in t) == sorted(names) and tiers[0] == [d.replica]


def test_what_was_sent_counts_as_held_until_the_hint_expires():
    """No stats yet (the replicas have not reported): the second request of a conversation
    follows the first to its replica; once the hint expired, load decides again."""
    now = [0.0]
    r = Ranker(hint_ttl_s=10.0)
    r.hints._clock = lambda: now[0]
    cands = [("a", {}), ("b", {})]
    first = r.rank(cands, CHAIN[:2])[1].replica
    second = r.rank(cands, CHAIN)[1]
    assert (second.replica, second.reason, second.matched_blocks) == (first, "prefix", 2)
    now[0] = 11.0
    assert r.rank(cands, CHAIN)[1].reason == "no-prefix"
    blind = Ranker(hint_ttl_s=0)
    a, b = (blind.rank(cands, CHAIN)[1].replica for _ in range(2))
    assert a != b  # without hints: ties in turn


def test_hints_are_bounded_and_forgotten_with_their_replica():
    from pagedkv.serve_ray.hints import RoutedHints

    hints = RoutedHints(ttl_s=60, max_blocks=3)
    hints.add("a", CHAIN)  # 4 blocks: the oldest goes
    assert hints.num_blocks("a") == 3 and hints.match(CHAIN, ["a"]) == {}
    hints.add("a", CHAIN[:1])
    assert hints.match(CHAIN, ["a", "b"]) == {"a": 1}
    hints.forget("a")
    assert hints.match(CHAIN, ["a"]) == {}
