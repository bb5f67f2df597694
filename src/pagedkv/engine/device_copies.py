"""Copies between the host and the device that do not stall the step loop.

On a GPU, ``torch.tensor(values, device="cuda")`` copies from pageable host memory, which torch
does as a blocking copy: the host waits until everything queued on the stream has run — a
whole forward pass when the engine schedules one step ahead. Made on the host, pinned, and
copied with ``non_blocking=True``, the same values are queued like a kernel instead (torch's
pinned allocator keeps the buffer until the copy has run). The other way, ``.cpu()`` of a
device tensor waits for the whole stream too, the next step's forward included:
``start_host_copy`` queues the copies into pinned memory right behind the work that made the
tensors, and ``HostCopy.wait`` waits for them only (an event recorded after them). On the CPU
every function here is the plain operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def host_tensor(values: Sequence[Any], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """``values`` as a host tensor, in page-locked memory when ``pinned`` (a GPU's copies from
    it can then be asynchronous)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory() if pinned else t


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, with no host sync on a GPU (module docstring)."""
    return upload(torch.tensor(values, dtype=dtype), device)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``: itself on the CPU; on a GPU copied from pinned memory
    without a host sync (``t`` is pinned first unless it is already)."""
    if device.type == "cpu":
        return t
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


@dataclass(frozen=True)
class HostCopy:
    """Host copies of some tensors, queued behind the work that made them; ``ready`` (a CUDA
    event) marks their arrival, None when they are on the host already."""

    tensors: tuple[torch.Tensor | None, ...]
    ready: Any = None

    def wait(self) -> tuple[torch.Tensor | None, ...]:
        """The host tensors, once their copies have run (waiting for them only)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensors


def start_host_copy(*tensors: torch.Tensor | None) -> HostCopy:
    """Queue each tensor's copy to pinned host memory on the current stream, and an event after
    them; CPU tensors are taken as they are (None stays None). Call it before queueing work
    the copies need not wait for."""
    if all(t is None or t.device.type == "cpu" for t in tensors):
        return HostCopy(tensors)
    copies = tuple(None if t is None else _pinned_copy(t) for t in tensors)
    ready = torch.cuda.Event()
    ready.record()
    return HostCopy(copies, ready)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
