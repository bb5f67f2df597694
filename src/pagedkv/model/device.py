"""Where the model runs: ``--device auto|cpu|cuda`` resolved once, at start-up, with the dtype
and the attention backend that go with it.

On the CPU pagedkv runs its own C kernels in fp32 (torch ops for bf16); on a GPU its Triton
kernels, in bf16 unless told otherwise (fp32 is allowed: the equality tests against the CPU path
need it). Torch SDPA over gathered K/V (``attention.py``) runs on either and stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import UsageError
from pagedkv.pages.backends import BackendRule, resolve_backend
from pagedkv.placement import check_device_name


@dataclass(frozen=True)
class Placement:
    """The device, activation dtype and attention backend of one engine. ``backend_note``: why
    the backend asked for was rewritten ("" when it was not)."""

    device: torch.device
    dtype: str  # an ENGINE_DTYPES name
    backend: BackendRule  # its entry of pages/backends.py
    backend_note: str = ""

    @property
    def attention_backend(self) -> str:
        return self.backend.name

    def describe(self) -> str:
        """The start-up line's words: ``cuda:0 (NVIDIA H200), bfloat16, attention triton``."""
        where = str(self.device)
        if self.device.type == "cuda":
            where += f" ({torch.cuda.get_device_name(self.device)})"
        note = self.backend.cpu_note if self.device.type == "cpu" else ""
        return f"device {where}, {self.dtype}, attention {self.backend.name}" + (
            f" ({note})" if note else ""
        )


def resolve_device(name: str) -> torch.device:
    """``auto``: the first GPU when torch sees one, else the CPU. ``UsageError`` (one line) for
    ``cuda`` on a machine without a CUDA device, or an unknown name."""
    check_device_name(name)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (
            "" if torch.version.cuda else ", a build without CUDA"
        )
        raise UsageError(f"no CUDA device is visible ({build}): use --device cpu", "device")
    device = torch.device("cuda" if name == "auto" else name)
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise UsageError(f"no CUDA device {index}: {torch.cuda.device_count()} visible", "device")
    return torch.device("cuda", index)


def make_current(device: torch.device) -> None:
    """Make a GPU ``device`` the current one: Triton launches, CUDA graph capture, events and
    streams act on the current device, so ``--device cuda:1`` would otherwise run kernels in
    cuda:0's context on cuda:1's memory. Nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def resolve_placement(
    device_name: str, dtype: str | None, attention_backend: str | None
) -> Placement:
    """The device, then the dtype (given, or fp32 on the CPU and bf16 on a GPU) and the backend
    (given, or the device's default: ``pages/backends.py``)."""
    device = resolve_device(device_name)
    rule, note = resolve_backend(attention_backend, device.type)
    dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
    return Placement(device, dtype, rule, note)
