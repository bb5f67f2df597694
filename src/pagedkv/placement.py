"""The names of where and how an engine runs, torch-free so that flags are checked before
torch loads: ``--device`` (``model/device.py`` resolves it on torch), ``--attention-backend``
(the names of ``pages/backends.py``'s table) and ``--weights`` (``model/quant.py`` builds the
quantized ones)."""

from __future__ import annotations

from pagedkv.errors import UsageError

DEVICES = ("auto", "cpu", "cuda")  # "cuda:N" names one GPU of several
# float: in --dtype, the reference. int4 / int8: exact on pagedkv's block kernels where they
# load. *-bf16: torch's int kernels with bf16 activations, rounding differently.
WEIGHT_FORMATS = ("float", "int8", "int4", "int8-bf16", "int4-bf16")


def check_device_name(name: str) -> None:
    """``UsageError`` naming ``device`` unless ``name`` is auto, cpu, cuda or cuda:N."""
    index = name.removeprefix("cuda:")
    if name in DEVICES or (index != name and index.isdigit()):
        return
    raise UsageError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}", "device")
