"""``StoreExecutor``: the store tier's engine side (the bytes; ``kvstore/`` has the facts).

``open_store`` builds it for ``--kv-store``: the ``kvstore.StoreTier`` the allocator holds
(namespace = this engine's page format + model identity) and the executor the runner's
``KVMover`` calls. A store that does not answer at start-up is logged once and the engine
serves anyway, recomputing until it answers. Per step:

* ``load``, before the forward pass: the step's store loads (verified and staged by the tier's
  ``match``, so nothing here can fail) are scattered into their fresh device blocks with one
  ``write_blocks`` per step;
* ``save``, after it: the step's newly full blocks are gathered once (``read_blocks``) and
  queued for the background writer, which encodes and sends them: the step pays the copy,
  never the encoding or the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv.block_copy import read_blocks, write_blocks
from pagedkv.engine.kv.identity import model_identity
from pagedkv.errors import UsageError
from pagedkv.kvcache.hashing import DEFAULT_HASH_ALGORITHM, BlockHash
from pagedkv.kvcache.policies import Policy
from pagedkv.kvcache.tiers.contract import TIER_STORE
from pagedkv.kvstore.address import parse_store_url
from pagedkv.kvstore.client import StoreClient
from pagedkv.kvstore.counters import StoreCounters
from pagedkv.kvstore.namespace import store_namespace
from pagedkv.kvstore.tier import StoreTier
from pagedkv.model.kv_pool import KVCache
from pagedkv.pages.page_format import PageFormat


class StoreExecutor:
    """The ``"store"`` executor (``mover.SaveExecutor``); ``tier`` is the allocator's (it
    declares that the store wants write-through saves)."""

    name = TIER_STORE

    def __init__(self, tier: StoreTier) -> None:
        self.tier = tier
        self.block_bytes = tier.body_bytes

    def load(
        self, kv_caches: list[KVCache], hashes: Sequence[BlockHash], device_blocks: Sequence[int]
    ) -> None:
        write_blocks(kv_caches, device_blocks, self.tier.take(hashes))

    def save(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        bodies = read_blocks(kv_caches, device_blocks)  # a copy: the blocks may be reused
        self.tier.submit(list(zip(hashes, bodies, strict=True)))

    def describe(self) -> str:
        """The start-up line (no prefix): where the store is, its namespace, whether it
        answered."""
        state = "NOT answering (recomputing until it does)" if self.tier.client.is_down else "up"
        return f"{self.tier.describe()}; {state}"


def check_store_policy(config: EngineConfig, policy: Policy) -> None:
    """``UsageError`` (before the weights load) when ``--kv-store`` meets a policy without a
    prefix cache keyed by block hash: the store's keys are those hashes."""
    if config.kv_store and (policy.allocator != "paged" or not policy.prefix_caching):
        raise UsageError(
            f"--kv-store needs a paged policy with a prefix cache (vllm, trtllm, paged:B); "
            f"{policy.name} has none keyed by block hash",
            param="kv_store",
        )


def store_tiers(
    config: EngineConfig, page_format: PageFormat, model: torch.nn.Module, kv_caches: list[KVCache]
) -> list[tuple[StoreTier, StoreExecutor]]:
    """``[(tier, executor)]`` for ``setup.attach_tiers``'s ``extra`` (empty: no store)."""
    if not config.kv_store:
        return []
    executor = open_store(config.kv_store, page_format, model_identity(model), kv_caches)
    return [(executor.tier, executor)]


def open_store(
    url: str, page_format: PageFormat, model_id: str, kv_caches: list[KVCache]
) -> StoreExecutor:
    """The store tier at ``url`` (``UsageError`` for a malformed URL; a store that is down is
    not an error: every lookup is a miss until it answers). The store keeps whole blocks, every
    KV head (``page_format.whole()``): a tensor-parallel engine's ranks join their head slices
    on the way there and split them on the way back (``engine/ranks/kv_ranks.py``), so engines
    of one model at any size share its keys."""
    client = StoreClient(parse_store_url(url), StoreCounters())
    whole = page_format.whole()
    namespace = store_namespace(whole, model_id, DEFAULT_HASH_ALGORITHM)
    body_bytes = whole.record_bytes * whole.block_size
    tier = StoreTier(client, namespace, body_bytes, page_format.block_size)
    client.ping()  # logs once if the store is down
    return StoreExecutor(tier)
