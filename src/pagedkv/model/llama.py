"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Usage by the engine (one call per step)::

    model = build_model(config)                  # on "meta"; then model.load_weights(...)
    kv = allocate_kv_caches(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                            config.head_dim, dtype)
    hidden = model(input_ids, positions, kv, AttentionMetadata(...), block_size)  # [T, H]
    logits = model.compute_logits(hidden[last_token_rows])                        # [N, V] fp32

Weights arrive under *canonical* names (``layers.{i}.q_proj.weight`` ...); loaders translate
file names into them, ``load_weights`` fuses Q/K/V and gate/up into single matmuls.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pagedkv.model.attention import AttentionPlan, paged_attention
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary

# Fused parameter of a layer → the canonical pieces it is the concatenation of (rows).
FUSED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "qkv_proj.bias": ("q_proj.bias", "k_proj.bias", "v_proj.bias"),
    "mlp.gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight"),
}
# Layer parameters stored one to one: ours → canonical.
LAYER_PARAMETERS: dict[str, str] = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "o_proj.weight": "o_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}
GLOBAL_PARAMETERS: dict[str, str] = {
    "embed_tokens.weight": "embed_tokens.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(self.input_norm(hidden)).split(
            (self.q_size, self.kv_size, self.kv_size), dim=-1
        )
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        hidden = hidden + self.o_proj(paged_attention(q, k, v, kv_cache, plan, self.scale))
        return hidden + self.mlp(self.post_attention_norm(hidden))


class CausalLM(nn.Module):
    """Decoder-only LM. Parameters start uninitialised-by-contract: call ``load_weights``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """Run the new tokens of one step; returns the final-normed hidden states ``[T, H]``.

        ``input_ids``/``positions``: int64 ``[T]`` in batch order (``query_start_loc``); the
        position of new token i of a sequence must be ``context_len - new_tokens + i`` (RoPE
        reads ``positions``, the causal mask reads the metadata; they must agree).
        ``kv_caches``: one ``(k, v)`` pair per layer; the new tokens' K/V are written into their
        slots (mutated in place). ``block_size`` defaults to the caches' dimension 1.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"need {self.config.num_layers} KV caches, got {len(kv_caches)}")
        want = (self.config.num_kv_heads, self.config.head_dim)
        if kv_caches[0][0].dim() != 4 or tuple(kv_caches[0][0].shape[2:]) != want:
            raise ValueError(
                f"KV caches must be [num_blocks, block_size, {want[0]}, {want[1]}], "
                f"got {tuple(kv_caches[0][0].shape)}"
            )
        num_tokens = attn_metadata.num_tokens
        if input_ids.shape != (num_tokens,) or positions.shape != (num_tokens,):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                f"must both be [{num_tokens}] (one per slot_mapping entry)"
            )
        block_size = block_size or kv_caches[0][0].shape[1]
        plan = AttentionPlan(attn_metadata, block_size, self.config.num_queries_per_kv)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, plan)
        return self.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of selected hidden rows (usually each sequence's last)."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Set every parameter from canonical-named tensors (converted to ``dtype``).

        Works on a model built on the ``meta`` device (``build_model``): parameters are replaced,
        not copied into. Raises ``ValueError`` naming missing, unexpected or mis-shaped tensors.
        The model may keep (alias) the given tensors: the caller hands them over.
        """
        expected = _canonical_names(self.config)
        missing = sorted(expected - weights.keys())
        unexpected = sorted(weights.keys() - expected - {"rope_freqs.weight"})
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        params = dict(self.named_parameters(remove_duplicate=False))
        sources: dict[str, torch.Tensor] = {
            ours: weights[canonical]
            for ours, canonical in GLOBAL_PARAMETERS.items()
            if canonical in weights
        }
        for i in range(self.config.num_layers):
            for ours, pieces in FUSED_PARAMETERS.items():
                if f"layers.{i}.{ours}" in params:
                    sources[f"layers.{i}.{ours}"] = torch.cat(
                        [weights[f"layers.{i}.{p}"] for p in pieces]
                    )
            for ours, canonical in LAYER_PARAMETERS.items():
                sources[f"layers.{i}.{ours}"] = weights[f"layers.{i}.{canonical}"]
        if self.config.tie_word_embeddings:
            sources["lm_head.weight"] = sources["embed_tokens.weight"]
        for name, tensor in sources.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, model wants {tuple(params[name].shape)}"
                )
            owner_name, _, leaf = name.rpartition(".")
            owner = self.get_submodule(owner_name)
            value = tensor.detach().to(dtype).contiguous()
            owner.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if "rope_freqs.weight" in weights:
            self.rotary.scale_frequencies(weights["rope_freqs.weight"])


def _canonical_names(config: ModelConfig) -> set[str]:
    names = {"embed_tokens.weight", "norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        per_layer = [*LAYER_PARAMETERS.values()]
        for ours, pieces in FUSED_PARAMETERS.items():
            if ours.endswith("bias") and not config.attention_bias:
                continue
            per_layer.extend(pieces)
        names.update(f"layers.{i}.{p}" for p in per_layer)
    return names


# The explicit architecture → model class table. All supported families share one forward.
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "mistral": CausalLM,
    "qwen2": CausalLM,
}


def build_model(config: ModelConfig) -> CausalLM:
    """An empty model of the class ``config.architecture`` names, parameters on ``meta``.

    Skipping random initialisation saves seconds; ``load_weights`` then sets every parameter.
    """
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    # The rotary frequencies are computed, not loaded: rebuild them on the CPU.
    model.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
    return model
