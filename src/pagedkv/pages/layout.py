"""The KV record layout of a model: bytes per token, per block, per layer, and model presets.

A *record* is one token's K and V across all layers (``record_bytes``, the article's ``c``).
A *block* is ``block_size`` records. A layout is derived from a model's ``ModelShape``
(``pages/sources.py`` reads presets, ``config.json`` files and GGUF headers) or from explicit
numbers (``layout_from_record_bytes``). Pure Python: no torch.

Public API (the simulator and the engine import these)::

    layout = load_layout("llama-3-8b", kv_dtype="fp16")
    layout.record_bytes            # 131072 (2 * 32 layers * 8 heads * 128 * 2 bytes)
    layout.block_bytes(16)         # 2 MiB
    layout.weight_bytes            # num_params * weight dtype bytes (None if unknown)
    layout_from_shape(shape, "fp8") # the same from an already read ModelShape
    mha_layout(30, 3, 64, "float32").block_bytes(16)  # an engine pool's block: 368640

Every record or block byte count in pagedkv is asked of a ``KVLayout``; nothing multiplies
heads by head_dim by layers on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedkv.pages.kv_dtypes import get_kv_dtype
from pagedkv.pages.shape import ModelShape
from pagedkv.pages.sources import load_shape
from pagedkv.units import check_block_size

# A kernel that forms `block_id * block_bytes` in a signed 32-bit integer can reach this byte.
INT32_MAX_OFFSET_BYTES = 2**31 - 1
ATTENTION_KINDS = ("mha", "mla", "explicit")


@dataclass(frozen=True)
class KVLayout:
    """How one token's KV is stored. Validated on construction; immutable.

    ``attention``: ``"mha"`` (MHA/GQA/MQA: a K and a V vector of ``head_dim`` per KV head and
    layer), ``"mla"`` (one compressed latent of ``kv_lora_rank + qk_rope_head_dim`` values per
    layer, no separate V) or ``"explicit"`` (``explicit_record_bytes`` given, one pseudo-layer).
    ``num_params`` (weights, for rooflines) may be None when unknown; ``query_dim`` (query
    heads x head dim, for attention FLOPs) is 0 when unknown.
    """

    name: str
    attention: str
    num_layers: int
    kv_dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    explicit_record_bytes: int = 0
    num_params: int | None = None
    weight_dtype: str = "bf16"
    query_dim: int = 0

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        # Canonicalise dtype spellings so that fingerprints compare equal ("bfloat16" == "bf16").
        object.__setattr__(self, "kv_dtype", get_kv_dtype(self.kv_dtype).name)
        object.__setattr__(self, "weight_dtype", get_kv_dtype(self.weight_dtype).name)
        if self.attention == "mha" and (self.num_kv_heads < 1 or self.head_dim < 1):
            raise ValueError(
                f"an MHA layout needs num_kv_heads >= 1 and head_dim >= 1, "
                f"got {self.num_kv_heads} and {self.head_dim}"
            )
        if self.attention == "mla" and self.kv_lora_rank < 1:
            raise ValueError(f"an MLA layout needs kv_lora_rank >= 1, got {self.kv_lora_rank}")
        if self.attention == "explicit" and self.explicit_record_bytes < 1:
            raise ValueError(f"record bytes must be >= 1, got {self.explicit_record_bytes}")
        if self.num_params is not None and self.num_params < 0:
            raise ValueError(f"num_params must be >= 0, got {self.num_params}")

    @property
    def layer_record_bytes(self) -> int:
        """Bytes of one token's KV in one layer (K and V, or the MLA latent), scales included."""
        dtype = get_kv_dtype(self.kv_dtype)
        if self.attention == "mha":
            return 2 * self.num_kv_heads * dtype.vector_bytes(self.head_dim)
        if self.attention == "mla":
            return dtype.vector_bytes(self.kv_lora_rank + self.qk_rope_head_dim)
        return self.explicit_record_bytes

    @property
    def record_bytes(self) -> int:
        """Bytes of one token's KV across all layers (the article's ``c``)."""
        return self.num_layers * self.layer_record_bytes

    def layer_block_bytes(self, block_size: int) -> int:
        """Bytes of one block in one layer: ``layer_record_bytes * block_size``."""
        check_block_size(block_size)
        return self.layer_record_bytes * block_size

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers: ``record_bytes * block_size``."""
        check_block_size(block_size)
        return self.record_bytes * block_size

    @property
    def weight_bytes(self) -> int | None:
        """Model weight bytes (``num_params`` x weight dtype bytes), None when unknown."""
        if self.num_params is None:
            return None
        return get_kv_dtype(self.weight_dtype).vector_bytes(self.num_params)


def pools_per_layer(attention: str) -> int:
    """Tensors an engine pool keeps per layer for this attention kind: K and V (``"mha"``), or
    the one latent record (``"mla"``); a block body is this many segments per layer."""
    if attention not in ("mha", "mla"):
        raise ValueError(f"no engine pool holds {attention!r} pages")
    return 2 if attention == "mha" else 1


def int32_max_pool_blocks(block_bytes: int) -> int:
    """Largest pool (in blocks) whose every byte offset ``block_id * block_bytes + i`` fits int32.

    The last byte of block ``n - 1`` is ``n * block_bytes - 1``, so ``n <= 2**31 // block_bytes``.
    """
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
    return (INT32_MAX_OFFSET_BYTES + 1) // block_bytes


def is_aligned(block_bytes: int, alignment_bytes: int) -> bool:
    """Whether consecutive block bases stay ``alignment_bytes``-aligned (pool base aligned)."""
    if alignment_bytes < 1:
        raise ValueError(f"alignment_bytes must be >= 1, got {alignment_bytes}")
    return block_bytes % alignment_bytes == 0


def layout_from_record_bytes(record_bytes: int, name: str = "explicit") -> KVLayout:
    """A layout known only by its record bytes (``--record-bytes c``)."""
    return KVLayout(
        name=name,
        attention="explicit",
        num_layers=1,
        kv_dtype="fp16",
        explicit_record_bytes=record_bytes,
    )


def mha_layout(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, name: str = "pool"
) -> KVLayout:
    """The MHA/GQA layout of an engine's pool (K and V of ``head_dim`` per KV head and layer):
    what the engine's swap pool, host tier, store bodies and profiler size their bytes by.
    ``kv_dtype`` in any spelling ``get_kv_dtype`` knows (``"float32"``, ``"bf16"`` ...)."""
    return KVLayout(
        name=name,
        attention="mha",
        num_layers=num_layers,
        kv_dtype=kv_dtype,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def layout_from_shape(shape: ModelShape, kv_dtype: str | None = None) -> KVLayout:
    """The KV record layout of ``shape``. ``kv_dtype`` defaults to the weights' dtype for a
    config.json or preset, and to fp16 for a GGUF (its KV dtype is a runtime choice; its
    weight dtype, fp32 after dequantization, would overstate a KV budget)."""
    if kv_dtype is None:
        kv_dtype = "fp16" if shape.source == "gguf" else shape.weight_dtype
    if shape.attention == "mla":
        fields: dict[str, int] = {
            "kv_lora_rank": shape.kv_lora_rank,
            "qk_rope_head_dim": shape.qk_rope_head_dim,
        }
    else:
        fields = {"num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
    return KVLayout(
        name=shape.name,
        attention=shape.attention,
        num_layers=shape.num_layers,
        kv_dtype=kv_dtype,
        num_params=shape.num_params,
        weight_dtype=shape.weight_dtype,
        query_dim=shape.query_dim,
        **fields,
    )


def load_layout(source: str | Path, kv_dtype: str | None = None) -> KVLayout:
    """Load a layout from a preset name, a ``config.json`` path, its folder, or a ``.gguf`` file
    (``pages/sources.py`` reads it). ValueError with one clear line for an unknown preset or
    an unreadable/invalid file."""
    return layout_from_shape(load_shape(source), kv_dtype)
