"""A GGUF file opened for its weights: the header read by ``pages/gguf_header.py``'s helpers,
then each tensor's bytes as a view of one memory map.

``gguf.GGUFReader`` builds a numpy object per vocabulary entry (about 2.4 s for the embedded
model's 49k tokens and merges); the pure-Python header reader takes ~0.2 s. The tensor objects
here carry what ``gguf.quants.dequantize`` and ``gguf_quants.py`` need: name, shape (fastest
dimension first, as GGUF and ``gguf`` list it), type and the raw data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import UsageError
from pagedkv.pages.gguf_header import GGUF_MAGIC, read_scalar, read_string, read_value

DEFAULT_ALIGNMENT = 32
# Plain element types keep their numpy dtype (gguf.quants.dequantize expects that); every block
# format is handed over as bytes, [rows, bytes per row].
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # fastest dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # read-only view of the memory map


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Header + tensor views of a GGUF v2/v3 file. ``FileNotFoundError`` for a missing path,
    ``UsageError`` naming the file for anything unreadable (bad magic, truncated, unknown type)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise UsageError("bad magic bytes")
            if read_scalar(f, "<I") not in (2, 3):
                raise UsageError("unsupported GGUF version")
            num_tensors, num_kv = read_scalar(f, "<Q"), read_scalar(f, "<Q")
            metadata: dict[str, Any] = {}
            for _ in range(num_kv):
                key = read_string(f)
                metadata[key] = read_value(f, read_scalar(f, "<I"))
            infos = []
            for _ in range(num_tensors):
                name = read_string(f)
                dims = tuple(read_scalar(f, "<Q") for _ in range(read_scalar(f, "<I")))
                infos.append((name, dims, read_scalar(f, "<I"), read_scalar(f, "<Q")))
            alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
            start = -(-f.tell() // alignment) * alignment
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = [_tensor(gguf, mapped, start, *info) for info in infos]
    except UsageError as exc:
        raise UsageError(f"{path} is not a readable GGUF file: {exc}") from None
    except (ValueError, OverflowError, MemoryError, struct.error, KeyError) as exc:
        raise UsageError(f"{path} is not a readable GGUF file: {exc!r}") from None
    return GGUFFile(path, metadata, tensors)


def _tensor(gguf: Any, mapped: np.ndarray, start: int, name, dims, type_id, offset) -> GGUFTensor:
    qtype = gguf.GGMLQuantizationType(type_id)
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    count = int(np.prod(dims)) if dims else 1
    if count % block_weights:
        raise UsageError(f"tensor {name}: {count} weights do not fill {qtype.name} blocks")
    nbytes = count // block_weights * block_bytes
    begin = start + offset
    if begin + nbytes > mapped.shape[0]:
        raise UsageError(f"tensor {name} runs past the end of the file")
    raw = mapped[begin : begin + nbytes]
    torch_order = tuple(int(d) for d in reversed(dims))
    if qtype.name in _PLAIN_DTYPES:
        data = raw.view(_PLAIN_DTYPES[qtype.name]).reshape(torch_order)
    else:
        rows = count // int(dims[0]) if dims else 1
        data = raw.reshape(rows, -1)
    return GGUFTensor(name, tuple(int(d) for d in dims), qtype, data)
