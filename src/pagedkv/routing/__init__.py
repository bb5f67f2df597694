"""Routing requests over replicas: the prefix index fed by KV events and the policies that
score replicas against it. Pure Python (no torch, no network): ``pagedkv route`` and
``pagedkv simulate --replicas`` run the same code."""

from pagedkv.routing.index import PrefixIndex, prompt_block_hashes
from pagedkv.routing.policy import (
    ROUTING_POLICIES,
    PrefixAware,
    ReplicaLoad,
    RouteDecision,
    RoutingPolicy,
    build_policy,
)

__all__ = [
    "ROUTING_POLICIES",
    "PrefixAware",
    "PrefixIndex",
    "ReplicaLoad",
    "RouteDecision",
    "RoutingPolicy",
    "build_policy",
    "prompt_block_hashes",
]
