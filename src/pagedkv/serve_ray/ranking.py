"""``Ranker``: the request router's decisions, without Ray: which replica a request goes to,
from the replicas' routing stats (load and the prefix blocks they hold, ``stats.py``) and the
requests this router has open on each.

The decision is ``pagedkv.routing``'s policy, the very object ``pagedkv route`` and
``pagedkv simulate --replicas`` ask: the longest cached prefix within the balance band, else
the least loaded. ``Ranker.rank`` turns it into Serve's ranked tiers: the chosen replica alone
first, then every other candidate (Serve takes the first tier with a replica whose queue is
not full, so a full chosen replica falls back to the rest instead of waiting).

**Load** of a replica = max(its ``num_requests`` at the last poll, the requests this router
sent there and has not seen complete), as ``pagedkv route`` counts it: the poll sees other
routers' traffic, the count reacts at once and lasts until the answer is delivered (a
stream's engine work may end well before its last event reaches the client). Not
thread-safe: Serve calls a router from one event loop.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.kvcache.hashing import BlockHash
from pagedkv.routing import PrefixIndex, ReplicaLoad, RouteDecision, build_policy
from pagedkv.serve_ray.hints import DEFAULT_TTL_S, RoutedHints
from pagedkv.serve_ray.stats import ReplicaStats, parse_stats
from pagedkv.untrusted import UntrustedInput

log = logging.getLogger("pagedkv.serve_ray")


class Ranker:
    """``policy``: a ``pagedkv.routing`` policy name; ``balance_abs`` / ``balance_rel`` its
    band. ``rank`` never raises on what replicas reported (bad stats count as none).
    ``name``: what ``describe`` calls it (the deployment it routes for). ``hint_ttl_s``:
    how long the blocks of a request sent to a replica count as held there (``hints.py``;
    0: never, only the replicas' reports count)."""

    def __init__(
        self,
        policy: str = "prefix-aware",
        balance_abs: int = 4,
        balance_rel: float = 0.25,
        max_index_entries: int = 1 << 20,
        name: str = "",
        hint_ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        self.name = name
        self.num_fallbacks = 0  # requests its router routed by load after failing itself
        LIVE_RANKERS.add(self)
        self.policy = build_policy(policy, balance_abs=balance_abs, balance_rel=balance_rel)
        self.index = PrefixIndex(max_index_entries)
        self.hints = RoutedHints(hint_ttl_s) if hint_ttl_s > 0 else None
        self.replicas: list[str] = []  # the running replicas, as Serve last said
        self.stats: dict[str, ReplicaStats] = {}  # replica -> last stats applied
        self._raw: dict[str, Any] = {}  # replica -> the stats object last read
        self.in_flight: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()  # reason -> requests
        self.bad_stats: Counter[str] = Counter()  # replica -> stats refused

    def observe(self, replica: str, raw: Any) -> ReplicaStats | None:
        """Take ``replica``'s latest routing stats; its index entries are rebuilt only when
        its (instance, epoch) changed. Refused stats keep what was known and are counted.
        The dict Serve last handed over is not parsed again (it keeps one until the next
        broadcast): a request costs no pass over every replica's hashes."""
        if raw is self._raw.get(replica):
            return self.stats.get(replica)
        self._raw[replica] = raw
        try:
            stats = parse_stats(raw)
        except UntrustedInput as exc:
            if not self.bad_stats[replica]:
                log.warning("routing stats of replica %s refused: %s", replica, exc)
            self.bad_stats[replica] += 1
            return self.stats.get(replica)
        if stats is None:
            return self.stats.get(replica)
        old = self.stats.get(replica)
        if old is None or (old.instance_id, old.epoch) != (stats.instance_id, stats.epoch):
            self.index.apply(replica, stats.snapshot_events())
        self.stats[replica] = stats
        return stats

    def forget(self, replica: str) -> None:
        """``replica`` is gone (dead, replaced, scaled down)."""
        self.index.drop_replica(replica)
        if self.hints is not None:
            self.hints.forget(replica)
        self.stats.pop(replica, None)
        self._raw.pop(replica, None)
        self.in_flight.pop(replica, None)

    def load(self, replica: str) -> int:
        stats = self.stats.get(replica)
        return max(stats.num_requests if stats else 0, self.in_flight[replica])

    def rank(
        self, candidates: Sequence[tuple[str, Mapping[str, Any]]], block_hashes: Sequence[BlockHash]
    ) -> tuple[list[list[str]], RouteDecision]:
        """``candidates``: (replica, its routing stats) in a stable order, non-empty. Returns
        the tiers (chosen first, then the others) and the policy's decision."""
        names = [name for name, _ in candidates]
        for name, raw in candidates:
            self.observe(name, raw)
        matched: dict[str, int] = {}
        use_index = self.policy.uses_prefix_index and bool(block_hashes)
        if use_index:
            held = self.index.match(block_hashes)
            hinted = self.hints.match(block_hashes, names) if self.hints else {}
            for n in names:
                if best := max(held.get(n, 0), hinted.get(n, 0)):
                    matched[n] = best
        decision = self.policy.choose([ReplicaLoad(n, self.load(n)) for n in names], matched)
        self.decisions[decision.reason] += 1
        if use_index and self.hints is not None:
            self.hints.add(decision.replica, block_hashes)
        rest = sorted((n for n in names if n != decision.replica), key=self.load)
        return [[decision.replica], rest], decision

    def sent(self, replica: str) -> None:
        """A request went to ``replica`` (Serve calls this for every request it sends)."""
        self.in_flight[replica] += 1

    def completed(self, replica: str) -> None:
        """A request to ``replica`` ended, however (Serve calls this once per sent request)."""
        if self.in_flight[replica] > 0:
            self.in_flight[replica] -= 1

    def describe(self) -> dict[str, Any]:
        """For ``/pagedkv/replicas``: each known replica's load and index size, the decisions."""
        return {
            "deployment": self.name,
            "policy": self.policy.name,
            "decisions": dict(self.decisions),
            "fallbacks": self.num_fallbacks,
            "replicas": [
                {
                    "replica": n,
                    "instance_id": s.instance_id,
                    "load": self.load(n),
                    "in_flight": self.in_flight[n],
                    "num_requests": s.num_requests,
                    "index_blocks": self.index.num_blocks(n),
                    "hinted_blocks": self.hints.num_blocks(n) if self.hints else 0,
                    "truncated": s.truncated,
                    "bad_stats": self.bad_stats[n],
                }
                for n, s in sorted(self.stats.items())
            ],
        }


# The rankers of this process: an ingress replica shows its router's (``/pagedkv/replicas``).
# Kept here, not beside the router class: Serve may ship that class by value, with its own
# copy of its module's globals.
LIVE_RANKERS: weakref.WeakSet[Ranker] = weakref.WeakSet()
