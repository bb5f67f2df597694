"""Routing policies: which replica gets a request. One code path for ``pagedkv route`` and
``pagedkv simulate --replicas``.

* ``round-robin``: replicas in turn; blind to load and to caches (the baseline).
* ``least-loaded``: the replica with the fewest requests (running + waiting); ties in turn.
* ``prefix-aware``: the replica holding the longest prefix of the request's blocks (from the
  KV event index), among the replicas whose load is within ``balance_abs`` requests or
  ``balance_rel`` of the least loaded one; no hit anywhere (or only on overloaded replicas):
  the least loaded. This is SGLang's cache-aware rule (cache when balanced, load when not)
  with the index built from events instead of from what the router sent, so a hit the router
  did not cause (a prefix another client warmed) counts too. The band keeps one hot prefix
  from piling every request onto one replica: once its holder is ``balance_abs`` requests
  ahead, the next request goes to another replica, which then holds the prefix too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.errors import UsageError


@dataclass(frozen=True)
class ReplicaLoad:
    """One routable replica as a policy sees it. ``num_requests``: running + waiting."""

    name: str
    num_requests: int


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why. ``reason``: ``rotation`` (round-robin), ``least-loaded``,
    ``prefix`` (longest cached prefix within the balance band), ``no-prefix`` (no replica in
    the band holds a block of it: least loaded), ``balance`` (a replica outside the band held a
    longer prefix: load won)."""

    replica: str
    policy: str
    reason: str
    matched_blocks: int  # of the request's blocks, on the chosen replica


class RoutingPolicy(Protocol):
    name: str
    uses_prefix_index: bool  # whether ``choose`` reads ``matched``

    def choose(self, replicas: Sequence[ReplicaLoad], matched: Mapping[str, int]) -> RouteDecision:
        """Pick one of ``replicas`` (non-empty, in a stable order). ``matched``: replica ->
        leading blocks of the request it holds (``PrefixIndex.match``)."""
        ...


class _Turns:
    """A counter that breaks ties in turn, so equal replicas share the work."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, candidates: Sequence[ReplicaLoad]) -> ReplicaLoad:
        self._turn += 1
        return candidates[self._turn % len(candidates)]


class RoundRobin:
    name, uses_prefix_index = "round-robin", False

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, replicas: Sequence[ReplicaLoad], matched: Mapping[str, int]) -> RouteDecision:
        r = self._turns.pick(replicas)
        return RouteDecision(r.name, self.name, "rotation", matched.get(r.name, 0))


def _least_loaded(replicas: Sequence[ReplicaLoad], turns: _Turns) -> ReplicaLoad:
    low = min(r.num_requests for r in replicas)
    return turns.pick([r for r in replicas if r.num_requests == low])


class LeastLoaded:
    name, uses_prefix_index = "least-loaded", False

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, replicas: Sequence[ReplicaLoad], matched: Mapping[str, int]) -> RouteDecision:
        r = _least_loaded(replicas, self._turns)
        return RouteDecision(r.name, self.name, "least-loaded", matched.get(r.name, 0))


class PrefixAware:
    name, uses_prefix_index = "prefix-aware", True

    def __init__(self, balance_abs: int = 4, balance_rel: float = 0.25) -> None:
        if not isinstance(balance_abs, int) or balance_abs < 0:
            raise UsageError(f"balance_abs must be an integer >= 0, got {balance_abs!r}")
        if not balance_rel >= 0:
            raise UsageError(f"balance_rel must be >= 0, got {balance_rel!r}")
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._turns = _Turns()

    def choose(self, replicas: Sequence[ReplicaLoad], matched: Mapping[str, int]) -> RouteDecision:
        low = min(r.num_requests for r in replicas)
        limit = low + max(self.balance_abs, self.balance_rel * low)
        band = [r for r in replicas if r.num_requests <= limit]
        best = max(matched.get(r.name, 0) for r in band)
        if best == 0:
            r = _least_loaded(band, self._turns)
            reason = "no-prefix"
        else:
            r = _least_loaded([r for r in band if matched.get(r.name, 0) == best], self._turns)
            reason = "prefix"
        if max(matched.values(), default=0) > best:
            reason = "balance"
        return RouteDecision(r.name, self.name, reason, best)


ROUTING_POLICIES = ("round-robin", "least-loaded", "prefix-aware")


def build_policy(name: str, *, balance_abs: int = 4, balance_rel: float = 0.25) -> RoutingPolicy:
    """A fresh policy (each keeps its own turn counter); UsageError names the choices."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(balance_abs, balance_rel)
    raise UsageError(
        f"unknown routing policy {name!r}; choose one of {', '.join(ROUTING_POLICIES)}"
    )
