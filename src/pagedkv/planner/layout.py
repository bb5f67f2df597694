"""The KV record layout of a model: bytes per token, per block, per layer, and model presets.

A *record* is one token's K and V across all layers (``record_bytes``, the article's ``c``).
A *block* is ``block_size`` records. Layouts come from a shipped preset (``list_presets()``),
a Hugging Face ``config.json`` (or the folder holding it), a GGUF file's metadata, or explicit
numbers (``layout_from_record_bytes``). Pure Python: no torch.

Public API (the simulator and the engine import these)::

    layout = load_layout("llama-3-8b", kv_dtype="fp16")
    layout.record_bytes            # 131072 (2 * 32 layers * 8 heads * 128 * 2 bytes)
    layout.block_bytes(16)         # 2 MiB
    layout.weight_bytes            # num_params * weight dtype bytes (None if unknown)
    list_presets()                 # ["deepseek-v3", "llama-3-8b", ...]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pagedkv.planner.kv_dtypes import get_kv_dtype

# A kernel that forms `block_id * block_bytes` in a signed 32-bit integer can reach this byte.
INT32_MAX_OFFSET_BYTES = 2**31 - 1
ATTENTION_KINDS = ("mha", "mla", "explicit")


@dataclass(frozen=True)
class KVLayout:
    """How one token's KV is stored. Validated on construction; immutable.

    ``attention``: ``"mha"`` (MHA/GQA/MQA: a K and a V vector of ``head_dim`` per KV head and
    layer), ``"mla"`` (one compressed latent of ``kv_lora_rank + qk_rope_head_dim`` values per
    layer, no separate V) or ``"explicit"`` (``explicit_record_bytes`` given, one pseudo-layer).
    ``num_params`` (weights, for rooflines) may be None when unknown.
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
        _check_block_size(block_size)
        return self.layer_record_bytes * block_size

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers: ``record_bytes * block_size``."""
        _check_block_size(block_size)
        return self.record_bytes * block_size

    @property
    def weight_bytes(self) -> int | None:
        """Model weight bytes (``num_params`` x weight dtype bytes), None when unknown."""
        if self.num_params is None:
            return None
        return get_kv_dtype(self.weight_dtype).vector_bytes(self.num_params)


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 token, got {block_size}")


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


def layout_from_hf_config(
    config: dict[str, Any], name: str, kv_dtype: str | None = None
) -> KVLayout:
    """Build a layout from a Hugging Face ``config.json`` dict (Llama, Qwen2, Mistral, DeepSeek).

    Models with ``kv_lora_rank`` are MLA. ``kv_dtype`` defaults to the config's ``torch_dtype``
    (bf16 when absent). ``num_params`` is taken from the dict when present (presets carry it),
    else estimated for dense Llama-style models, else None.
    """
    try:
        num_layers = int(config["num_hidden_layers"])
        weight_dtype = str(config.get("torch_dtype") or "bf16")
        if config.get("kv_lora_rank"):
            fields: dict[str, Any] = {
                "attention": "mla",
                "kv_lora_rank": int(config["kv_lora_rank"]),
                "qk_rope_head_dim": int(config.get("qk_rope_head_dim", 0)),
            }
        else:
            num_heads = int(config["num_attention_heads"])
            head_dim = config.get("head_dim") or int(config["hidden_size"]) // num_heads
            fields = {
                "attention": "mha",
                "num_kv_heads": int(config.get("num_key_value_heads") or num_heads),
                "head_dim": int(head_dim),
            }
    except KeyError as exc:
        raise ValueError(f"model config {name!r} lacks the key {exc.args[0]!r}") from None
    num_params = config.get("num_params")
    if num_params is None and fields["attention"] == "mha":
        num_params = estimate_dense_num_params(config)
    return KVLayout(
        name=name,
        num_layers=num_layers,
        kv_dtype=kv_dtype or weight_dtype,
        num_params=None if num_params is None else int(num_params),
        weight_dtype=weight_dtype,
        **fields,
    )


def estimate_dense_num_params(config: dict[str, Any]) -> int | None:
    """Parameter count of a dense Llama/Qwen2/Mistral config (None if a needed key is missing).

    Embeddings (+ an untied LM head), per layer q/k/v/o projections (+ q/k/v biases for Qwen2),
    a gated MLP of three matrices and two RMSNorms, and the final norm.
    """
    try:
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = int(config.get("head_dim") or hidden // num_heads)
        intermediate = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
        num_layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError):
        return None
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    per_layer = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    archs = " ".join(config.get("architectures") or [])
    if config.get("attention_bias") or "Qwen2" in archs:
        per_layer += q_dim + 2 * kv_dim
    per_layer += 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return num_layers * per_layer + embeddings + hidden


def _presets_dir() -> Path:
    return Path(str(resources.files("pagedkv").joinpath("presets")))


def list_presets() -> list[str]:
    """Names of the shipped model presets, sorted."""
    return sorted(p.stem for p in _presets_dir().glob("*.json"))


def load_preset_config(name: str) -> dict[str, Any]:
    """The raw JSON dict of preset ``name`` (ValueError naming the known presets if unknown)."""
    path = _presets_dir() / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(list_presets())})")
    return json.loads(path.read_text())


def load_layout(source: str | Path, kv_dtype: str | None = None) -> KVLayout:
    """Load a layout from a preset name, a ``config.json`` path, its folder, or a ``.gguf`` file.

    Raises ValueError with one clear line for an unknown preset or an unreadable/invalid file.
    """
    text = str(source)
    path = Path(text)
    if text in list_presets():
        return layout_from_hf_config(load_preset_config(text), text, kv_dtype)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        from pagedkv.planner.gguf_meta import layout_from_gguf

        return layout_from_gguf(path, kv_dtype)
    if not path.is_file():
        if path.suffix or "/" in text:
            raise ValueError(f"cannot read model config {text!r}: no such file")
        raise ValueError(f"unknown model preset {text!r} (known: {', '.join(list_presets())})")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {text!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"model config {text!r} is not a JSON object")
    return layout_from_hf_config(config, str(config.get("name") or path.parent.name), kv_dtype)
