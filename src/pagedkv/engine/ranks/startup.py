"""Start-up's ranks section (rank 0's side of ``engine/startup.py``): spawn the workers as soon
as the pool's plan is checked (they load their shares while rank 0 loads its own), join the
group, then size and build every rank's pools, and say so in the start-up lines.

At ``--tensor-parallel-size 1`` every method is a no-op and the engine is one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv.host_tier import HostKVTier
from pagedkv.engine.memory import PoolSize
from pagedkv.engine.pool_plan import PoolPlan
from pagedkv.engine.ranks.group import Rendezvous, free_port, leave, rank_threads
from pagedkv.engine.ranks.kv_ranks import HeadSlices, RankedStore
from pagedkv.engine.ranks.messages import BuildOrder, SizeOrder, WorkerSpec
from pagedkv.engine.ranks.runner import RankRunner
from pagedkv.engine.ranks.workers import Workers
from pagedkv.engine.runner import ModelRunner
from pagedkv.errors import UsageError
from pagedkv.kvcache.tiers.contract import TIER_HOST
from pagedkv.kvstore.tier import StoreTier
from pagedkv.model.config import ModelConfig
from pagedkv.model.parallel import TensorRank, TPGroup
from pagedkv.model.shards import RankShard

# A worker's weight load (imports, the file read and sliced, a GGUF dequantized): generous,
# a loaded machine reads slowly; a worker that dies is seen at once anyway.
LOAD_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 300.0


class Ranks:
    """Rank 0's ranks section: ``workers`` and ``group`` (None at one rank)."""

    def __init__(self, config: EngineConfig, plan: PoolPlan) -> None:
        self.config, self.plan = config, plan
        self.size = plan.split.tp_size
        self.workers: Workers | None = None
        self.group: TPGroup | None = None
        self.threads = torch.get_num_threads()
        if self.size == 1:
            return
        if dist.is_initialized():  # torch.distributed's default group is the process's one
            raise UsageError(
                "another tensor-parallel engine runs in this process: close() it first (one "
                "engine of --tensor-parallel-size > 1 a process at a time)",
                "tensor_parallel_size",
            )
        on_cpu = plan.placement.device.type == "cpu"
        if on_cpu:
            self.threads = rank_threads(self.size, self.threads)
        rendezvous = Rendezvous(free_port(), self.size, plan.placement.device.type)
        main = threading.current_thread() is threading.main_thread()
        specs = [
            WorkerSpec(config, plan, rank, rendezvous, self.threads, main)
            for rank in range(1, self.size)
        ]
        self.workers = Workers.start(specs)
        try:
            if on_cpu:
                torch.set_num_threads(self.threads)
            self.group = rendezvous.join(0)
        except BaseException:
            self.close()
            raise

    def rank(self, model_config: ModelConfig) -> TensorRank | None:
        """Rank 0's share of the model to load (None: the whole model)."""
        if self.group is None:
            return None
        shard = RankShard.of(model_config, self.size, 0, self.config.weights)
        return TensorRank(shard, self.group)

    def runner_type(self) -> Callable[..., ModelRunner]:
        """The runner of this rank: a ``RankRunner`` in its group, at one rank the plain one."""
        return ModelRunner if self.group is None else partial(RankRunner, group=self.group)

    def wait_loaded(self) -> None:
        if self.workers is not None:
            self.workers.replies("loaded", LOAD_TIMEOUT_S)

    def start_sizing(self) -> None:
        """Have the workers measure their cards now (their profile step meets rank 0's)."""
        if self.workers is not None:
            self.workers.send(SizeOrder())

    def least(self, size: PoolSize) -> PoolSize:
        """Rank 0's pool size, or the least any rank's card leaves (one block count for all)."""
        if self.workers is None:
            return size
        theirs = [r.value for r in self.workers.replies("sized", BUILD_TIMEOUT_S)]
        least = min(size.kv_bytes, *theirs)
        return PoolSize(least, f"{size.line}; the least of {self.size} ranks' cards")

    def build(self, runner: ModelRunner, num_host_kv_blocks: int, store: StoreTier | None) -> None:
        """Every worker's pools (the same blocks as rank 0's, of its heads), then rank 0's
        runner linked to them: its host tier's slots and its store's bytes go to the ranks."""
        if self.workers is None or self.group is None:
            return
        swap = runner.swap_pool.num_blocks if runner.swap_pool is not None else 0
        order = BuildOrder(runner.num_blocks, swap, num_host_kv_blocks, store is not None)
        self.workers.send(order)
        self.workers.replies("built", BUILD_TIMEOUT_S)
        assert isinstance(runner, RankRunner)
        runner.link = self.workers
        host = runner.mover.executor(TIER_HOST)
        if isinstance(host, HostKVTier):
            self.workers.host_index = host.index

    def store_executor(self, runner: ModelRunner, tier: StoreTier) -> RankedStore | None:
        """The store's executor over the ranks (None at one rank: the plain one)."""
        if self.group is None:
            return None
        return RankedStore(self.group, HeadSlices(runner.page, self.plan.split), tier)

    def lines(self) -> list[str]:
        """The start-up lines: the ranks and their heads, the threads."""
        split = self.plan.split
        if self.size == 1:
            return []
        where = "gloo" if self.plan.placement.device.type == "cpu" else "NCCL (host bytes: gloo)"
        lines = [
            f"tensor parallel: {split.describe()}; {self.size - 1} worker process{'es' if self.size > 2 else ''}, {where}"
        ]
        if self.plan.placement.device.type == "cpu":
            lines.append(f"threads: {self.threads} per rank ({self.size} ranks share the cores)")
        return lines

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self.workers is not None:
            self.workers.stop()
        leave()
        self.group = None
