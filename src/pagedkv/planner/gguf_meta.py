"""Read a GGUF file's header (metadata and tensor shapes) in pure Python, for the KV layout.

Only the header is read: no tensor data, no numpy. The parameter count is the sum of the
tensor element counts, which is exact. The KV dtype is not stored in a GGUF (it is a runtime
choice), so it defaults to fp16; the weight dtype is fp32 because pagedkv dequantizes GGUF
weights once at load (see DESIGN.md), which is what a memory budget must count.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from pagedkv.planner.layout import KVLayout

GGUF_MAGIC = b"GGUF"
# value type id -> struct format of a scalar (8 = string, 9 = array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _read_string(f: BinaryIO) -> str:
    length = _read(f, "<Q")
    data = f.read(length)
    if len(data) != length:
        raise ValueError("truncated GGUF string")
    return data.decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, value_type: int) -> Any:
    if value_type in _SCALARS:
        return _read(f, _SCALARS[value_type])
    if value_type == 8:
        return _read_string(f)
    if value_type == 9:
        item_type, count = _read(f, "<I"), _read(f, "<Q")
        if item_type in _SCALARS:  # read a scalar array in one go (token scores, types ...)
            fmt = _SCALARS[item_type]
            data = f.read(struct.calcsize(fmt) * count)
            return list(struct.unpack(f"<{count}{fmt[1:]}", data))
        return [_read_value(f, item_type) for _ in range(count)]
    raise ValueError(f"unknown GGUF value type {value_type}")


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """Return (metadata dict, tensor name -> shape) of a GGUF v2/v3 file."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{str(path)!r} is not a GGUF file")
        version = _read(f, "<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        num_tensors, num_kv = _read(f, "<Q"), _read(f, "<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = _read_string(f)
            metadata[key] = _read_value(f, _read(f, "<I"))
        shapes: dict[str, tuple[int, ...]] = {}
        for _ in range(num_tensors):
            name = _read_string(f)
            num_dims = _read(f, "<I")
            shapes[name] = tuple(_read(f, "<Q") for _ in range(num_dims))
            _read(f, "<I")  # tensor type
            _read(f, "<Q")  # data offset
    return metadata, shapes


def layout_from_gguf(path: str | Path, kv_dtype: str | None = None) -> KVLayout:
    """Build a KV layout from a GGUF file's metadata (ValueError if keys are missing)."""
    metadata, shapes = read_gguf_header(path)
    arch = metadata.get("general.architecture")
    if not arch:
        raise ValueError(f"GGUF {str(path)!r} lacks general.architecture")

    def key(name: str) -> Any:
        if f"{arch}.{name}" not in metadata:
            raise ValueError(f"GGUF {str(path)!r} lacks {arch}.{name}")
        return metadata[f"{arch}.{name}"]

    num_params = 0
    for shape in shapes.values():
        count = 1
        for dim in shape:
            count *= dim
        num_params += count
    common: dict[str, Any] = {
        "name": str(metadata.get("general.name") or Path(path).stem),
        "num_layers": int(key("block_count")),
        "kv_dtype": kv_dtype or "fp16",
        "num_params": num_params,
        "weight_dtype": "fp32",
    }
    if f"{arch}.attention.kv_lora_rank" in metadata:
        return KVLayout(
            attention="mla",
            kv_lora_rank=int(key("attention.kv_lora_rank")),
            qk_rope_head_dim=int(metadata.get(f"{arch}.rope.dimension_count", 0)),
            **common,
        )
    num_heads = int(key("attention.head_count"))
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = int(key("embedding_length")) // num_heads
    return KVLayout(
        attention="mha",
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        **common,
    )
