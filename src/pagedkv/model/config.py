"""``ModelConfig``: what the forward pass needs, built from the one ``ModelShape`` that
``pages/sources.py`` reads out of a GGUF header or a Hugging Face ``config.json``.

It dispatches on the *parsed* architecture name through ``ARCHITECTURES``; a file name never
decides anything. An architecture outside the table is a ``UsageError`` that names the
supported ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedkv.errors import UsageError
from pagedkv.pages.mla_shape import MLADims, YarnRopeScaling
from pagedkv.pages.moe_shape import MoEShape
from pagedkv.pages.shape import Llama3RopeScaling, ModelShape, check_head_groups


@dataclass(frozen=True)
class ArchitectureSpec:
    """What differs between the supported families: a row of this table, read by the one
    decoder layer (``decoder_layer.py``) and the loaders. All of them run the same forward."""

    name: str
    default_attention_bias: bool
    # llama.cpp's converter permutes the Q/K rows of Llama-family weights so that its RoPE can
    # rotate adjacent pairs; Qwen files use the half-split ("NeoX") RoPE and are stored as is.
    gguf_qk_permuted: bool
    # Q and K normalised per head (an RMSNorm over head_dim) before RoPE: Qwen3.
    qk_norm: bool = False
    # "mha" (Q, K, V heads; K and V cached) or "mla" (DeepSeek's latent attention, one latent
    # record cached per token: ``model/mla/``); the MLP is SwiGLU, or the experts where the
    # shape has them (``ModelConfig.moe``).
    attention: str = "mha"


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec("llama", default_attention_bias=False, gguf_qk_permuted=True),
    "mistral": ArchitectureSpec("mistral", default_attention_bias=False, gguf_qk_permuted=True),
    "qwen2": ArchitectureSpec("qwen2", default_attention_bias=True, gguf_qk_permuted=False),
    "qwen3": ArchitectureSpec(
        "qwen3", default_attention_bias=False, gguf_qk_permuted=False, qk_norm=True
    ),
    # DeepSeek: HF names the two generations apart; llama.cpp's GGUF calls both "deepseek2"
    # (their routing differs by the header's gating and group keys, ``pages/gguf_mla.py``).
    **{
        name: ArchitectureSpec(
            name, default_attention_bias=False, gguf_qk_permuted=False, attention="mla"
        )
        for name in ("deepseek_v2", "deepseek_v3", "deepseek2")
    },
}


def architecture_spec(name: str | None, source: str) -> ArchitectureSpec:
    """The spec of a parsed architecture name (HF ``model_type`` and GGUF
    ``general.architecture`` spell the supported ones alike); ``UsageError`` when unsupported."""
    if name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UsageError(
            f"unsupported model architecture {name!r} (from {source} metadata); "
            f"supported: {supported}"
        )
    return ARCHITECTURES[name]


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
    # The latent attention's dims (the "mla" families), DeepSeek's YaRN, the experts.
    mla: MLADims | None = None
    yarn: YarnRopeScaling | None = None
    moe: MoEShape | None = None
    # The shape read from the model file (None for a config built by hand).
    shape: ModelShape | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise UsageError(f"unknown architecture {self.architecture!r}")
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
                raise UsageError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        check_head_groups(self.num_heads, self.num_kv_heads, "ModelConfig")
        if self.head_dim % 2:
            raise UsageError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise UsageError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise UsageError(f"rope_theta must be > 0, got {self.rope_theta}")
        if (self.mla is not None) != (self.family.attention == "mla"):
            raise UsageError(f"{self.architecture} needs {self.family.attention} dims")
        if self.mla is not None and self.mla.qk_head_dim != self.head_dim:
            raise UsageError(
                f"head_dim {self.head_dim} differs from qk_nope_head_dim + qk_rope_head_dim "
                f"({self.mla.qk_head_dim})"
            )

    @property
    def family(self) -> ArchitectureSpec:
        """What this model's family changes in the one decoder layer (``ARCHITECTURES``)."""
        return ARCHITECTURES[self.architecture]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_shape(cls, shape: ModelShape) -> ModelConfig:
        """The forward pass's config of a model shape (``pages/sources.py`` read the file).

        ``UsageError`` for what this engine cannot run: an architecture outside
        ``ARCHITECTURES``, an attention kind other than its family's, partial rotary
        embeddings, a RoPE scaling other than llama3 (yarn: the MLA families), or a fact the
        shape lacks or gets inconsistent (naming the file's key).
        """
        spec = architecture_spec(shape.architecture, shape.source)
        mla = spec.attention == "mla"
        if shape.attention != spec.attention:
            raise UsageError(
                f"model {shape.origin}: {spec.name} has {spec.attention.upper()} attention, "
                f"the file describes {shape.attention.upper()} (kv_lora_rank)"
            )
        if not mla and shape.rope_dims is not None and shape.rope_dims != shape.head_dim:
            raise UsageError(
                f"partial rotary embeddings ({shape.rope_dims} of {shape.head_dim}) "
                "are not supported"
            )
        scalings = ("default", "yarn") if mla else ("default", "llama3")
        if shape.rope_scaling_type not in scalings:
            raise UsageError(
                f"unsupported rope scaling type {shape.rope_scaling_type!r} for {spec.name} "
                f"(supported: {', '.join(scalings)})"
            )
        if mla and shape.attention_bias:
            raise UsageError(f"model {shape.origin}: attention_bias is not supported for MLA")
        max_context = shape.require("max_context_tokens")
        if shape.sliding_window_tokens is not None:
            # Attention within the window is exact, so capping the context keeps us exact.
            max_context = min(max_context, shape.sliding_window_tokens)
        bias = shape.attention_bias
        return cls(
            architecture=spec.name,
            vocab_size=shape.require("vocab_size"),
            hidden_size=shape.require("hidden_size"),
            intermediate_size=shape.require("intermediate_size"),
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=shape.require("rms_norm_eps"),
            rope_theta=shape.rope_theta,
            rope_scaling=shape.rope_scaling,
            max_position_embeddings=max_context,
            tie_word_embeddings=shape.tie_word_embeddings,
            attention_bias=spec.default_attention_bias if bias is None else bias,
            bos_token_id=shape.bos_token_id,
            eos_token_ids=shape.eos_token_ids,
            mla=shape.mla_dims() if mla else None,
            yarn=shape.yarn,
            moe=shape.moe,
            shape=shape,
        )

    def model_shape(self) -> ModelShape:
        """The shape this config was built from; a hand-built config (tests) describes itself."""
        if self.shape is not None:
            return self.shape
        return ModelShape(
            name=self.architecture,
            source="hf",
            origin=f"<{self.architecture} config>",
            architecture=self.architecture,
            attention="mha",
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            max_context_tokens=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )
