"""Loading pagedkv's Triton kernels: once per process, for one kind of device.

Triton decides when it is first imported whether kernels compile for a GPU or run in its
interpreter (``TRITON_INTERPRET=1``, numpy on CPU tensors: slow, exact, what the tests use).
So the kernel modules are imported here only, after that choice is made for the device the
engine runs on; a process that loaded them for one kind cannot run them on the other.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from pagedkv.errors import UsageError

_MODULES = (
    "decode",
    "decode_split",
    "prefill",
    "kv_write",
    "block_copy",
    "rope_kv_write",
    "silu_mul",
    "rms_norm",
    "mla_decode",
    "mla_write",
)
_loaded: dict[str, TritonKernels] = {}


@dataclass(frozen=True)
class TritonKernels:
    """The kernels' launch wrappers and the rules that size them (see each module)."""

    interpreted: bool  # True: Triton's interpreter on CPU tensors (tests), not compiled code
    paged_decode: Any
    decode_splits: Any
    paged_prefill: Any
    prefill_tiles: Any
    write_kv: Any
    copy_blocks: Any
    rope_write_kv: Any  # RoPE + the K/V store in one launch (TritonPlan.rope_attend)
    silu_mul: Any
    rms_norm: Any  # RMSNorm, alone or after the residual add, in one launch
    mla_decode: Any  # MLA: absorbed decode over latent pages (mla_decode.py)
    write_latents: Any  # MLA: the step's latent records into their slots


def load_kernels(device: torch.device) -> TritonKernels:
    """The kernels for ``device`` (a CUDA GPU: compiled; the CPU: interpreted). ``UsageError``
    when triton is not installed, or the process already loaded them for the other kind."""
    kind = "interpreted" if device.type == "cpu" else "compiled"
    if kind in _loaded:
        return _loaded[kind]
    if _loaded:
        raise UsageError(
            f"the Triton kernels were loaded {next(iter(_loaded))} in this process; "
            f"{device} needs them {kind} (one kind per process)",
            "device",
        )
    if kind == "interpreted" and os.environ.get("TRITON_INTERPRET") != "1":
        # triton fixes the mode at its first import (transformers, for one, imports it).
        if os.environ.get("TRITON_INTERPRET", "1") != "1" or "triton" in sys.modules:
            raise UsageError(
                "the triton backend on the CPU runs Triton's interpreter: start the process "
                "with TRITON_INTERPRET=1",
                "attention_backend",
            )
        os.environ["TRITON_INTERPRET"] = "1"
    modules = {name: _import(name) for name in _MODULES}
    kernels = TritonKernels(
        interpreted=kind == "interpreted",
        paged_decode=modules["decode"].paged_decode,
        decode_splits=modules["decode_split"].decode_splits,
        paged_prefill=modules["prefill"].paged_prefill,
        prefill_tiles=modules["prefill"].prefill_tiles,
        write_kv=modules["kv_write"].write_kv,
        copy_blocks=modules["block_copy"].copy_blocks,
        rope_write_kv=modules["rope_kv_write"].rope_write_kv,
        silu_mul=modules["silu_mul"].silu_mul,
        rms_norm=modules["rms_norm"].rms_norm,
        mla_decode=modules["mla_decode"].mla_decode,
        write_latents=modules["mla_write"].write_latents,
    )
    _loaded[kind] = kernels
    return kernels


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"pagedkv.model.triton.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == "triton" or (exc.name or "").startswith("triton."):
            raise UsageError(
                "the triton attention backend needs the triton package "
                "(pip install 'triton>=3.6,<3.10')",
                "attention_backend",
            ) from None
        raise


def num_sms(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (the split-K rule fills them); 1 on the CPU, where
    the interpreter runs programs one by one and splitting only adds a reduction."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
