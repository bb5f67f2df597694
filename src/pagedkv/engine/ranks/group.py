"""The ranks' process group and each rank's share of the machine.

``torch.distributed`` with a TCP rendezvous on the loopback (rank 0 listens on a free port): on
the CPU one gloo group carries everything; on GPUs (one device a rank, ``cuda:base + rank``)
NCCL carries the model's collectives on device tensors and a gloo group the host bytes of the
store's blocks. Every collective has a timeout (``COLLECTIVE_TIMEOUT_S``): a rank that stops
answering ends the engine with an error instead of a hang (a rank that dies ends it at once:
gloo sees the closed connection).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedkv.cpu_share import usable_cores
from pagedkv.model.parallel import TPGroup

# Longer than any step (a long prompt's prefill on a busy CPU), short enough to end a hang.
COLLECTIVE_TIMEOUT_S = 300.0
# Joining the group: the workers import torch and pagedkv first (seconds; a loaded machine
# more), rank 0 waits this long for them.
JOIN_TIMEOUT_S = 120.0


def free_port() -> int:
    """A free TCP port on the loopback for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the ranks meet: the loopback port rank 0 listens on, their count, and the
    device kind (``cpu`` or ``cuda``) that picks the backend."""

    port: int
    size: int
    device_type: str

    def join(self, rank: int) -> TPGroup:
        """Join as ``rank`` (blocks until every rank has); the group's collectives."""
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{self.port}",
            rank=rank,
            world_size=self.size,
            timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        )
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        # The model's collectives on the device; the store's bytes on the host (gloo).
        device_group = dist.new_group(backend=backend, timeout=timeout)
        cpu_group = (
            device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        )
        return TPGroup(rank, self.size, device_group, cpu_group)


def leave() -> None:
    """Leave the process group (nothing when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the ``rank``-th GPU from ``base``'s, or the CPU."""
    if base.type != "cuda":
        return base
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"rank {rank} needs cuda:{index}: {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def rank_threads(size: int, ceiling: int) -> int:
    """Each rank's intra-op threads on the CPU: its share of the cores this process may use,
    at most ``ceiling`` (torch's count at start-up), at least one."""
    return max(1, min(ceiling, usable_cores() // size))
