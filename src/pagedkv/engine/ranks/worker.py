"""A worker's life (ranks 1..N-1): join the group, load its share, build its pools, run steps.

It runs the same code as rank 0 from the step's message on (``ModelRunner.run_step``: the KV
orders, the forward pass with its collectives, the logits' gather), and nothing of the
engine's: no scheduler, no sampler, no store connection, no HTTP. Any exception is reported to
rank 0 (``Failed``, one line and the traceback's tail) and ends the process: its collectives
cannot be resumed. It ignores Ctrl-C (rank 0 stops it), exits when rank 0's pipe closes, and on
Linux dies with the process that spawned it.
"""

from __future__ import annotations

import contextlib
import ctypes
import pickle
import signal
import sys
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection

import torch

from pagedkv.engine.card_memory import card_start, measure_card, profile_peak_bytes
from pagedkv.engine.kv.host_tier import HostKVTier
from pagedkv.engine.memory import kv_bytes_from_card
from pagedkv.engine.ranks.group import leave, rank_device
from pagedkv.engine.ranks.kv_ranks import FollowedIndex, HeadSlices, RankedStore, TierRole
from pagedkv.engine.ranks.messages import (
    STOP,
    BuildOrder,
    Failed,
    LogitsOrder,
    Reply,
    SizeOrder,
    StepMessage,
    WorkerSpec,
)
from pagedkv.engine.ranks.runner import RankRunner
from pagedkv.kvcache.tiers.contract import TIER_HOST, TIER_STORE
from pagedkv.model.attention_backend import make_backend
from pagedkv.model.config import ModelConfig
from pagedkv.model.device import make_current
from pagedkv.model.loader import load_model, read_model_shape
from pagedkv.model.parallel import TensorRank
from pagedkv.model.shards import RankShard

_PR_SET_PDEATHSIG = 1


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The process's target: everything a worker does, its failure reported to rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    if spec.die_with_parent and sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    try:
        torch.set_num_threads(spec.threads)
        runner = _build(spec, conn)
        _serve(runner, conn)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this process ends
        detail = "".join(traceback.format_exception(exc)[-6:])
        print(f"pagedkv rank {spec.rank}: {detail}", file=sys.stderr, flush=True)
        _send(conn, Failed(spec.rank, f"{type(exc).__name__}: {exc}"[:500], detail[-2000:]))
        sys.exit(1)
    finally:
        leave()


def _send(conn: Connection, message: object) -> None:
    with contextlib.suppress(OSError):  # rank 0 is gone
        conn.send_bytes(pickle.dumps(message))


def _receive(conn: Connection) -> object:
    """The next message; ``STOP`` when rank 0's end of the pipe closed."""
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        return STOP


def _build(spec: WorkerSpec, conn: Connection) -> RankRunner:
    """Join, load this rank's share, size and build its pools as rank 0 orders."""
    plan, config, rank = spec.plan, spec.config, spec.rank
    placement = replace(plan.placement, device=rank_device(plan.placement.device, rank))
    make_current(placement.device)
    start = card_start(placement.device) if plan.num_blocks is None else None
    group = spec.rendezvous.join(rank)
    full = ModelConfig.from_shape(read_model_shape(config.model))
    shard = RankShard.of(full, group.size, rank, config.weights)
    _, model, _ = load_model(
        config.model,
        placement.dtype,
        progress=False,
        weights=config.weights,
        device=placement.device,
        rank=TensorRank(shard, group),
    )
    backend = make_backend(placement.backend, model, model.device)
    page = plan.page_format.whole().for_rank(plan.split, rank)
    _send(conn, Reply(rank, "loaded"))
    order = _receive(conn)
    if isinstance(order, SizeOrder):
        assert start is not None

        def peak() -> int:  # rank 0's largest step, in step: its collectives meet ours
            return profile_peak_bytes(
                model,
                backend,
                page,
                config.max_num_batched_tokens,
                plan.max_model_len,
                config.max_num_seqs,
            )

        card = measure_card(placement.device, start, peak)
        _send(
            conn,
            Reply(rank, "sized", kv_bytes_from_card(card, config.gpu_memory_utilization).kv_bytes),
        )
        order = _receive(conn)
    if not isinstance(order, BuildOrder):
        raise RuntimeError(f"rank {rank} expected its pools' sizes, got {order!r}")
    runner = RankRunner(
        model, full, page, order.num_blocks, order.num_swap_blocks, backend, group=group
    )
    if order.num_host_kv_blocks:
        index = FollowedIndex(order.num_host_kv_blocks)
        host = HostKVTier(index, page, placement.device)  # type: ignore[arg-type]
        runner.mover.attach(TierRole(TIER_HOST, True, False), host)  # type: ignore[arg-type]
    if order.store:
        store = RankedStore(group, HeadSlices(page, plan.split), None)
        runner.mover.attach(TierRole(TIER_STORE, False, True), store)  # type: ignore[arg-type]
    _send(conn, Reply(rank, "built"))
    return runner


def _serve(runner: RankRunner, conn: Connection) -> None:
    """Run every step rank 0 sends until ``STOP``."""
    host = runner.mover.executor(TIER_HOST)
    model = runner.model
    while True:
        message = _receive(conn)
        if message == STOP:
            return
        if isinstance(message, StepMessage):
            if isinstance(host, HostKVTier):
                host.index.slots = message.host_slots  # type: ignore[attr-defined]
            runner.run_step(message.orders, message.inputs, None)
        elif isinstance(message, LogitsOrder):
            hidden = torch.empty(
                message.rows, model.config.hidden_size, dtype=model.dtype, device=model.device
            )
            runner.compute_logits(runner.tp.broadcast_first(hidden))
        else:
            raise RuntimeError(f"unexpected message {message!r}")
