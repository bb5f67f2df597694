"""``DeviceTensor``: a CPU tensor that refuses host reads the way a GPU tensor does.

``serve --device cuda`` once died at start-up because the model identity called ``.numpy()`` on
a CUDA weight, and nothing on a machine without a GPU could see it. A ``DeviceTensor`` computes
like any CPU tensor (every op's result is a ``DeviceTensor`` again), but ``.numpy()`` raises the
``TypeError`` torch raises for a CUDA tensor, and so do ``.tolist()``, ``.item()`` and Python
scalar conversions (on a GPU those are hidden host syncs; here they are refused). An explicit
``.cpu()`` (or ``.to("cpu")``) returns a plain host tensor, as the real one would.
"""

from __future__ import annotations

import torch

_HOST_READS = {
    torch.Tensor.numpy,
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
}


class DeviceTensor(torch.Tensor):
    """Wrap with ``t.as_subclass(DeviceTensor)`` (``on_device``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise TypeError(
                f"{func.__name__}: can't convert cuda:0 device type tensor to host memory "
                "without an explicit copy (use Tensor.cpu() first)"
            )
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_host(args, kwargs)):
            with torch._C.DisableTorchFunctionSubclass():
                return torch.Tensor.as_subclass(func(*args, **kwargs), torch.Tensor)
        return super().__torch_function__(func, types, args, kwargs)


def _to_host(args, kwargs) -> bool:
    where = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(where, str | torch.device):
        return torch.device(where).type == "cpu"
    return False


def on_device(t: torch.Tensor) -> DeviceTensor:
    """``t`` (shared memory) as a ``DeviceTensor``."""
    return t.as_subclass(DeviceTensor)
