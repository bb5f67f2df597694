"""``ModelShape``: what a model is, as far as paging, planning and loading care (layers, heads,
KV heads, head dim, query width, vocabulary, parameters, context, RoPE and norm facts). Built by
``pages.sources`` from a preset, a ``config.json`` or a GGUF header; pure Python, no torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.pages.gguf_header import GGUF_KEYS
from pagedkv.pages.mla_shape import MLADims, YarnRopeScaling
from pagedkv.pages.moe_shape import MoEShape

ATTENTION_KINDS = ("mha", "mla")
# The key each optional fact has in a config.json (GGUF_KEYS: in a GGUF header).
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "max_context_tokens": "max_position_embeddings",
}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """The "llama3" RoPE frequency rescaling (long wavelengths slowed by ``factor``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= 0:
            raise UsageError(f"llama3 rope scaling factors must be > 0: {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise UsageError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor: {self}"
            )
        if self.original_max_position_embeddings < 1:
            raise UsageError(f"original_max_position_embeddings must be >= 1: {self}")

    @classmethod
    def from_dict(cls, rope: Mapping[str, Any]) -> Llama3RopeScaling:
        """From a config.json's ``rope_scaling`` / ``rope_parameters`` (KeyError if short)."""
        return cls(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape, as its source states it; validated on construction.

    ``attention`` ``"mha"`` (MHA/GQA/MQA) or ``"mla"`` (one latent of ``kv_lora_rank +
    qk_rope_head_dim`` values per layer). ``head_dim`` is the width of one query head, so
    ``query_dim`` = heads x head dim; for MLA ``num_kv_heads`` equals ``num_heads`` (no KV heads
    are cached). ``architecture`` is the source's own name (HF ``model_type``, GGUF
    ``general.architecture``), None when a config.json does not say. ``weight_dtype`` is what
    the weights occupy once loaded (GGUF weights are dequantized to fp32).
    """

    name: str
    source: str  # "preset", "hf" or "gguf"
    origin: str  # the file (or preset) it came from, for error messages
    architecture: str | None
    attention: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_params: int | None = None
    max_context_tokens: int | None = None  # the model's trained context
    sliding_window_tokens: int | None = None  # None = full attention
    weight_dtype: str = "bf16"
    rms_norm_eps: float | None = None
    rope_theta: float = 10000.0
    rope_dims: int | None = None  # rotary dimensions per head; None = all of head_dim
    rope_scaling_type: str = "default"
    rope_scaling: Llama3RopeScaling | None = None  # parsed when the type is "llama3"
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # None: the source does not say
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # MLA's other dims (``mla_dims``; the record's are kv_lora_rank and qk_rope_head_dim),
    # DeepSeek's YaRN (rope_scaling_type "yarn") and the experts (None: a dense MLP).
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = False
    yarn: YarnRopeScaling | None = None
    moe: MoEShape | None = None

    def __post_init__(self) -> None:
        where = f"model {self.origin}"
        if self.attention not in ATTENTION_KINDS:
            raise UsageError(f"{where}: attention must be one of {ATTENTION_KINDS}")
        required = ["num_layers", "num_heads", "num_kv_heads", "head_dim"]
        required += ["kv_lora_rank"] if self.attention == "mla" else []
        optional = ["vocab_size", "hidden_size", "intermediate_size", "max_context_tokens"]
        for field in required + optional:
            value = getattr(self, field)
            if (value is not None or field in required) and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise UsageError(f"{where}: {field} must be an integer >= 1, got {value!r}")
        if self.num_params is not None and self.num_params < 0:
            raise UsageError(f"{where}: num_params must be >= 0, got {self.num_params}")
        check_head_groups(self.num_heads, self.num_kv_heads, where)

    @property
    def query_dim(self) -> int:
        """Width of a token's queries in one layer (heads x head dim): the attention FLOPs."""
        return self.num_heads * self.head_dim

    def mla_dims(self) -> MLADims:
        """The latent attention's dims (``UsageError`` naming the key that is missing or
        inconsistent: an MLA model's forward pass needs every one)."""
        if self.attention != "mla":
            raise UsageError(f"model {self.origin} has no latent attention (MLA)")
        return MLADims(
            num_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope_interleaved=self.rope_interleaved,
        )

    def require(self, field: str) -> Any:
        """The value of an optional fact; UsageError naming the source's key when absent."""
        value = getattr(self, field)
        if value is None:
            key = _HF_KEYS.get(field, field)
            if self.source == "gguf":
                key = f"{self.architecture}.{GGUF_KEYS.get(field, field)}"
            raise UsageError(f"model {self.origin} lacks {key!r}")
        return value


def check_head_groups(num_heads: int, num_kv_heads: int, where: str) -> None:
    """Each KV head serves a whole group of query heads (GQA): the one rule, for the planner's
    shapes and the model's config alike."""
    if num_heads % num_kv_heads:
        raise UsageError(
            f"{where}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
