"""What rank 0 and its workers say to each other through their pipes (pickled, host only).

Rank 0 -> a worker: its ``WorkerSpec`` (at spawn), then ``SizeOrder`` (a GPU pool sized from
the cards), ``BuildOrder`` (the pools' block counts), then one ``StepMessage`` per step, a
``LogitsOrder`` where rank 0 needs logits outside a step (prompt scoring), and ``STOP``.
A worker -> rank 0: ``Reply`` (loaded, sized, built) or ``Failed`` (its error, then it exits).
Device tensors never travel here: the step's are host tensors the runner made; what lives on a
device goes through the group's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.pool_plan import PoolPlan
from pagedkv.engine.ranks.group import Rendezvous
from pagedkv.engine.runner import StepInputs
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.sched.batch import ScheduledBatch

STOP = "stop"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker starts from: the engine's config and rank 0's plan of the pool (the
    same page, block size and placement), its rank, the rendezvous, its threads, and whether
    it dies with its parent (Linux, spawned from the main thread)."""

    config: EngineConfig
    plan: PoolPlan
    rank: int
    rendezvous: Rendezvous
    threads: int
    die_with_parent: bool


@dataclass(frozen=True)
class SizeOrder:
    """Measure this rank's card for the pool (``engine/memory.py``): after the weights, the
    largest step (run on every rank at once: its collectives)."""


@dataclass(frozen=True)
class BuildOrder:
    """Build this rank's pools: ``num_blocks`` device blocks, a swap pool of
    ``num_swap_blocks`` and a host tier of ``num_host_kv_blocks`` host blocks (0: none), and
    whether a store tier moves blocks (its bytes join and split over the ranks)."""

    num_blocks: int
    num_swap_blocks: int
    num_host_kv_blocks: int
    store: bool


@dataclass(frozen=True)
class StepMessage:
    """One step for every worker: ``orders`` is the scheduler's batch without its sequences
    (its KV orders: offloads, swaps, copies, loads, saves), ``inputs`` the step's host tensors
    (None: nothing to run, only copies), ``host_slots`` the host tier's slot of each hash the
    orders move to or from it (rank 0's index decides)."""

    orders: ScheduledBatch
    inputs: StepInputs | None
    host_slots: dict[BlockHash, int]

    @classmethod
    def of(
        cls, batch: ScheduledBatch, inputs: StepInputs | None, host_slots: dict[BlockHash, int]
    ) -> StepMessage:
        orders = replace(batch, seqs=(), preempted=(), refused=())
        return cls(orders, inputs, host_slots)


@dataclass(frozen=True)
class LogitsOrder:
    """Compute the logits of ``rows`` hidden rows that rank 0 broadcasts next."""

    rows: int


@dataclass(frozen=True)
class Reply:
    """A worker's answer to rank 0: ``what`` it did (``loaded``, ``sized``, ``built``),
    ``value`` (the KV bytes its card leaves, for ``sized``)."""

    rank: int
    what: str
    value: int = 0


@dataclass(frozen=True)
class Failed:
    """A worker's last message: what failed (one line) and its traceback's tail."""

    rank: int
    error: str
    detail: str = ""
