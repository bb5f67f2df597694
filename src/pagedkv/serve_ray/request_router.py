"""``PagedKVRequestRouter``: pagedkv's prefix-aware routing as Ray Serve's request router
(``RequestRouterConfig(request_router_class=...)`` of the engine deployment).

Serve runs one router per deployment handle (here: in each ingress replica, for its handle
to the engines) and asks ``choose_replicas(candidates, pending_request)`` for ranked tiers;
it then takes, in the first tier holding one, the replica with the shortest queue that is
not full. The ranking is ``Ranker``'s (``ranking.py``): the policy module ``pagedkv route``
uses, fed by the replicas' ``record_routing_stats`` (load, prefix blocks held) and this
router's own count of open requests (``on_send_request`` / ``on_request_completed``, which
Serve calls for every request; ``on_request_routed`` only with strict queue limits).

It never raises into Serve's routing loop: a request without well-formed block hashes is
routed by load, and anything unexpected (a bug included) is logged once and answered with
every candidate in one tier, which is Serve's own choice by queue length.
"""

from __future__ import annotations

import logging

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedkv.serve_ray.call import call_block_hashes, call_pin
from pagedkv.serve_ray.ranking import Ranker

log = logging.getLogger("pagedkv.serve_ray")


class PagedKVRequestRouter(RequestRouter):
    def initialize_state(
        self,
        policy: str = "prefix-aware",
        balance_abs: int = 4,
        balance_rel: float = 0.25,
        hint_ttl_s: float = 60.0,
    ) -> None:
        self.ranker = Ranker(
            policy, balance_abs, balance_rel, name=str(self._deployment_id), hint_ttl_s=hint_ttl_s
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        try:
            by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
            pin = call_pin(pending_request.args if pending_request else None)
            if pin is not None:  # gone: none (the caller's timeout ends the wait)
                return [[by_name[pin]]] if pin in by_name else []
            hashes = call_block_hashes(pending_request.args if pending_request else None)
            stats = [(name, r.routing_stats or {}) for name, r in sorted(by_name.items())]
            tiers, _ = self.ranker.rank(stats, hashes)
            return [[by_name[name] for name in tier] for tier in tiers if tier]
        except Exception:  # noqa: BLE001 - Serve's loop must go on: route by queue length
            if not self.ranker.num_fallbacks:
                log.exception("pagedkv's request router failed; routing by load")
            self.ranker.num_fallbacks += 1
            return [list(candidate_replicas)]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)  # Serve's queue-length cache
        self.ranker.sent(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ranker.completed(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {r.unique_id for r in self._replica_id_set}
        super().update_replicas(replicas)
        gone -= {r.unique_id for r in self._replica_id_set}
        for name in gone:  # dead, replaced or scaled down: its cache went with it
            self.ranker.forget(name)
        self.ranker.replicas = sorted(r.unique_id for r in self._replica_id_set)
        for replica in replicas:  # new stats arrive with the replicas: index them now
            self.ranker.observe(replica.replica_id.unique_id, replica.routing_stats or {})
