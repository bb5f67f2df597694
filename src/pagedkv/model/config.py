"""``ModelConfig``: the shape of a decoder-only transformer, parsed once from a model file.

Two sources feed it: GGUF metadata (``general.architecture`` plus ``<arch>.*`` keys) and a
Hugging Face ``config.json``. Both dispatch on the *parsed* architecture name through
``ARCHITECTURES``; a file name never decides anything. An architecture outside the table is a
``ValueError`` that names the supported ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchitectureSpec:
    """What differs between the supported families. All of them run the same forward pass."""

    name: str
    default_attention_bias: bool
    # llama.cpp's converter permutes the Q/K rows of Llama-family weights so that its RoPE can
    # rotate adjacent pairs; Qwen2 files use the half-split ("NeoX") RoPE and are stored as is.
    gguf_qk_permuted: bool


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec("llama", default_attention_bias=False, gguf_qk_permuted=True),
    "mistral": ArchitectureSpec("mistral", default_attention_bias=False, gguf_qk_permuted=True),
    "qwen2": ArchitectureSpec("qwen2", default_attention_bias=True, gguf_qk_permuted=False),
}

# Hugging Face ``model_type`` → our architecture name.
HF_MODEL_TYPES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# GGUF ``general.architecture`` → our architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def architecture_spec(name: str, source: str) -> ArchitectureSpec:
    """The spec of a parsed architecture name; ``ValueError`` when it is not supported."""
    table = HF_MODEL_TYPES if source == "hf" else GGUF_ARCHITECTURES
    if name not in table:
        supported = ", ".join(sorted(table))
        raise ValueError(
            f"unsupported model architecture {name!r} (from {source} metadata); "
            f"supported: {supported}"
        )
    return ARCHITECTURES[table[name]]


@dataclass(frozen=True)
class Llama3RopeScaling:
    """The "llama3" RoPE frequency rescaling (long wavelengths slowed by ``factor``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= 0:
            raise ValueError(f"llama3 rope scaling factors must be > 0: {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor: {self}"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"original_max_position_embeddings must be >= 1: {self}")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass and the KV layout need; validated on construction."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: Llama3RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_record_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one token's K and V across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling)."""
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str):
            raise ValueError("config.json has no 'model_type'")
        spec = architecture_spec(model_type, "hf")
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // num_heads
            # transformers 5 folds rope_theta and rope_scaling into "rope_parameters".
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            max_pos = int(cfg.get("max_position_embeddings", 2048))
            window = cfg.get("sliding_window")
            if window and cfg.get("use_sliding_window", True) and int(window) < max_pos:
                # Attention within the window is exact, so capping the context keeps us exact.
                max_pos = int(window)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            return cls(
                architecture=spec.name,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=_parse_hf_rope_scaling(rope),
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", spec.default_attention_bias)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as exc:
            raise ValueError(f"config.json is missing {exc.args[0]!r}") from exc

    # ------------------------------------------------------------------ GGUF
    @classmethod
    def from_gguf_metadata(
        cls, meta: Mapping[str, Any], tensor_names: frozenset[str]
    ) -> ModelConfig:
        """Parse GGUF key/value metadata (already decoded to Python values).

        ``tensor_names`` decides what metadata cannot: tied embeddings (no ``output.weight``)
        and attention bias (``attn_q.bias`` present).
        """
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError("GGUF metadata has no 'general.architecture'")
        spec = architecture_spec(arch, "gguf")

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata is missing '{arch}.{name}'")
            return value

        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // num_heads))
        rope_dims = int(key("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise ValueError(
                f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported"
            )
        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ValueError(f"unsupported GGUF rope scaling type {scaling!r}")
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=spec.name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=None,  # llama3 GGUFs carry the factors as the rope_freqs tensor
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )


def _parse_hf_rope_scaling(rope: Mapping[str, Any]) -> Llama3RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")
    return Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
