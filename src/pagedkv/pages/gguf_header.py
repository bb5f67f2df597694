"""Read a GGUF file's header (metadata and tensor shapes) in pure Python: no tensor data, no numpy.

This is the file-format reader only; what the keys *mean* (the model's shape) is decided in
``pages/sources.py``. ``read_scalar``, ``read_string`` and ``read_value`` are public: the
weight loader (``model/gguf_file.py``) walks the same header with them. Reading the embedded
135M model's header (49k-token vocabulary included) takes about 0.04 s, against seconds for
the weights, so start-up may read it before the load.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, BinaryIO

from pagedkv.errors import UsageError

GGUF_MAGIC = b"GGUF"
# value type id -> struct format of a scalar (8 = string, 9 = array are handled apart)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def _read_bytes(f: BinaryIO, size: int) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise UsageError("truncated GGUF header")
    return data


def read_scalar(f: BinaryIO, fmt: str) -> Any:
    """One little-endian scalar of ``struct`` format ``fmt`` (``"<I"``, ``"<Q"`` ...) read from
    ``f``; UsageError("truncated GGUF header") when the file ends first."""
    return struct.unpack(fmt, _read_bytes(f, struct.calcsize(fmt)))[0]


def read_string(f: BinaryIO) -> str:
    """One GGUF string (u64 length, then UTF-8 bytes; invalid bytes replaced) read from ``f``;
    UsageError when truncated."""
    return _read_bytes(f, read_scalar(f, "<Q")).decode("utf-8", errors="replace")


def _read_strings(f: BinaryIO, count: int) -> list[str]:
    """``count`` strings in one tight loop: a vocabulary and its merges are ~100k of them, and
    four calls per string made them a third of the embedded model's load time."""
    out, read, length = [], f.read, struct.Struct("<Q")
    for _ in range(count):
        head = read(8)
        size = length.unpack(head)[0] if len(head) == 8 else -1
        data = read(size) if size >= 0 else b""
        if len(data) != size:
            raise UsageError("truncated GGUF header")
        out.append(data.decode("utf-8", errors="replace"))
    return out


def read_value(f: BinaryIO, value_type: int) -> Any:
    """One metadata value of GGUF type id ``value_type`` (a scalar, a string, or an array of
    them, read whole) from ``f``. UsageError for a truncated value or an unknown type id."""
    if value_type in _SCALARS:
        return read_scalar(f, _SCALARS[value_type])
    if value_type == 8:
        return read_string(f)
    if value_type == 9:
        item_type, count = read_scalar(f, "<I"), read_scalar(f, "<Q")
        if item_type in _SCALARS:  # read a scalar array in one go (token scores, types ...)
            fmt = _SCALARS[item_type]
            data = _read_bytes(f, struct.calcsize(fmt) * count)
            return list(struct.unpack(f"<{count}{fmt[1:]}", data))
        if item_type == 8:
            return _read_strings(f, count)
        return [read_value(f, item_type) for _ in range(count)]
    raise UsageError(f"unknown GGUF value type {value_type}")


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """Return (metadata dict, tensor name -> shape, fastest dimension first) of a GGUF v2/v3
    file. ``UsageError`` naming the file for anything that is not a readable GGUF header;
    ``FileNotFoundError`` when there is no such file."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise UsageError("bad magic bytes")
            version = read_scalar(f, "<I")
            if version not in (2, 3):
                raise UsageError(f"unsupported GGUF version {version}")
            num_tensors, num_kv = read_scalar(f, "<Q"), read_scalar(f, "<Q")
            metadata: dict[str, Any] = {}
            for _ in range(num_kv):
                key = read_string(f)
                metadata[key] = read_value(f, read_scalar(f, "<I"))
            shapes: dict[str, tuple[int, ...]] = {}
            for _ in range(num_tensors):
                name = read_string(f)
                num_dims = read_scalar(f, "<I")
                shapes[name] = tuple(read_scalar(f, "<Q") for _ in range(num_dims))
                read_scalar(f, "<I")  # tensor type
                read_scalar(f, "<Q")  # data offset
    except FileNotFoundError:
        raise FileNotFoundError(f"model file not found: {path}") from None
    except (ValueError, OverflowError, MemoryError, struct.error) as exc:
        raise UsageError(f"{path} is not a readable GGUF file: {exc}") from None
    return metadata, shapes


# Where each shape fact lives in a GGUF header, after "<general.architecture>.".
GGUF_KEYS = {
    "num_layers": "block_count",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "vocab_size": "vocab_size",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_context_tokens": "context_length",
    "rope_theta": "rope.freq_base",
    "rope_dims": "rope.dimension_count",
    "kv_lora_rank": "attention.kv_lora_rank",
}


def gguf_shape_fields(
    metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], origin: str
) -> dict[str, Any]:
    """The ``ModelShape`` fields a GGUF header states (``pages/sources.py`` builds the shape).

    Tensor names decide what metadata cannot: tied embeddings (no ``output.weight``) and
    attention bias (``blk.0.attn_q.bias``). The parameter count is the sum of the tensor
    element counts, which is exact. Weights load dequantized unless ``--weights`` keeps them
    quantized (``model/quant.py``), which a memory budget must count. UsageError naming a
    missing required key.
    """
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise UsageError(f"GGUF {origin} lacks general.architecture")

    def get(field: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{GGUF_KEYS[field]}", default)

    def require(field: str) -> int:
        value = get(field)
        if value is None:
            raise UsageError(f"GGUF {origin} lacks {arch}.{GGUF_KEYS[field]}")
        return int(value)

    num_params = sum(math.prod(shape) for shape in tensor_shapes.values())
    num_heads = require("num_heads")
    hidden = get("hidden_size")
    head_dim = get("head_dim")
    if head_dim is None:
        head_dim = require("hidden_size") // num_heads
    mla = get("kv_lora_rank") is not None
    vocab = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ()) or None
    scaling = metadata.get(f"{arch}.rope.scaling.type") or "none"
    fields: dict[str, Any] = {
        "architecture": arch,
        "attention": "mla" if mla else "mha",
        "num_layers": require("num_layers"),
        "num_heads": num_heads,
        "num_kv_heads": num_heads if mla else int(get("num_kv_heads", num_heads)),
        "head_dim": int(head_dim),
        "kv_lora_rank": int(get("kv_lora_rank", 0)),
        "qk_rope_head_dim": int(get("rope_dims", 0)) if mla else 0,
        "vocab_size": None if vocab is None else int(vocab),
        "hidden_size": None if hidden is None else int(hidden),
        "intermediate_size": _opt_int(get("intermediate_size")),
        "num_params": num_params,
        "max_context_tokens": _opt_int(get("max_context_tokens")),
        "weight_dtype": "fp32",
        "rms_norm_eps": None if get("rms_norm_eps") is None else float(get("rms_norm_eps")),
        "rope_theta": float(get("rope_theta", 10000.0)),
        "rope_dims": _opt_int(get("rope_dims")),
        # llama3 GGUFs carry their factors as the rope_freqs tensor, not as a scaling type
        "rope_scaling_type": "default" if scaling == "none" else str(scaling),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
    }
    fields.update(_tokens_and_name(metadata))
    return fields


def _tokens_and_name(metadata: dict[str, Any]) -> dict[str, Any]:
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    fields: dict[str, Any] = {
        "bos_token_id": _opt_int(metadata.get("tokenizer.ggml.bos_token_id")),
        "eos_token_ids": () if eos is None else (int(eos),),
    }
    if metadata.get("general.name"):
        fields["name"] = str(metadata["general.name"])
    return fields


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
