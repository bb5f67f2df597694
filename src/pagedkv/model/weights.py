"""How canonical-named weights land in a model (``CausalLM.load_weights``): the tables from a
layer's projections and norms to the canonical pieces they are built from (Q, K and V fused into
one product, gate and up into another), and the loaders of the model's ends and of each layer,
which check every shape against the model and build each projection with the factory given
(fp32 on pagedkv's C kernels, torch, or quantized: ``quant.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from pagedkv.model.config import ModelConfig
from pagedkv.model.decoder_layer import DecoderLayer
from pagedkv.model.deepseek_weights import (
    deepseek_names,
    deepseek_norms,
    deepseek_projections,
    is_moe_layer,
    load_deepseek,
    rope_reordered,
)
from pagedkv.model.native.projection import NativeProjection
from pagedkv.model.projection import Projection, ProjectionBase, projection_from_pieces

# A layer's projections → the canonical pieces their weight (and bias) concatenate, by rows.
PROJECTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "qkv_proj": (
        ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
        ("q_proj.bias", "k_proj.bias", "v_proj.bias"),
    ),
    "o_proj": (("o_proj.weight",), ()),
    "mlp.gate_up_proj": (("gate_proj.weight", "up_proj.weight"), ()),
    "mlp.down_proj": (("down_proj.weight",), ()),
}
# Layer parameters stored one to one: ours → canonical (the q/k norms where the family has
# them: ``config.ARCHITECTURES``).
LAYER_PARAMETERS: dict[str, str] = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
}
HEAD_NORM_PARAMETERS: dict[str, str] = {
    "q_norm.weight": "q_norm.weight",
    "k_norm.weight": "k_norm.weight",
}
# Builds one projection (a ``ProjectionBase``) from its fused weight ``[out, in]`` and bias or
# None: by default ``Projection`` in the model dtype; ``quant.py`` makes the quantized ones.
ProjectionFactory = Callable[[str, torch.Tensor, torch.Tensor | None], ProjectionBase]


def check_names(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming missing or unexpected tensors."""
    expected = canonical_names(config)
    missing = sorted(expected - weights.keys())
    unexpected = sorted(weights.keys() - expected - {"rope_freqs.weight"})
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def load_ends(model, load: Load) -> None:
    """The embedding, the LM head (tied or not) and the final norm."""
    cfg, weights, dtype = model.config, load.weights, load.dtype
    embed = weights["embed_tokens.weight"]
    lm_head = embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
    _check_shape("embed_tokens.weight", embed, (cfg.vocab_size, cfg.hidden_size))
    _check_shape("lm_head.weight", lm_head, (cfg.vocab_size, cfg.hidden_size))
    model.lm_head = projection_from_pieces("lm_head", [lm_head], [], dtype, load.make_projection)
    if cfg.tie_word_embeddings and isinstance(model.lm_head, (Projection, NativeProjection)):
        model.embed_tokens = None
    else:
        model.embed_tokens = nn.Embedding.from_pretrained(embed.to(dtype), freeze=True)
    model.norm.weight = _parameter("norm.weight", weights["norm.weight"], model.norm, dtype)
    model.norm.kernels = load.kernels if cfg.hidden_size % 8 == 0 else None


@dataclass(frozen=True)
class Load:
    """One ``load_weights`` call's inputs, as each part's loader reads them."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    dtype: torch.dtype
    make_projection: ProjectionFactory | None
    kernels: object | None  # native.kernels() where the weights go on them


def load_layer(load: Load, i: int, layer: DecoderLayer) -> None:
    """Layer ``i``'s projections (fused from their canonical pieces) and norms; DeepSeek's
    latent attention and experts (``deepseek_weights.py``)."""
    weights, dtype = rope_reordered(load.config, i, load.weights), load.dtype
    for ours, (weight_names, bias_names) in layer_projections(load.config, i).items():
        old = layer.get_submodule(ours)
        pieces = [weights[f"layers.{i}.{p}"] for p in weight_names]
        biases = [weights[f"layers.{i}.{p}"] for p in bias_names if old.bias is not None]
        rows = sum(p.shape[0] for p in pieces)
        for name, piece in zip(weight_names, pieces, strict=True):
            _check_shape(f"layers.{i}.{name}", piece, (piece.shape[0], old.in_features))
        if rows != old.out_features:
            raise ValueError(f"layers.{i}.{ours}: {rows} rows, model wants {old.out_features}")
        new = projection_from_pieces(
            f"layers.{i}.{ours}", pieces, biases, dtype, load.make_projection
        )
        owner, _, leaf = ours.rpartition(".")
        setattr(layer.get_submodule(owner) if owner else layer, leaf, new)
    for ours, canonical in layer_parameters(load.config).items():
        norm = layer.get_submodule(ours.rpartition(".")[0])
        name = f"layers.{i}.{canonical}"
        norm.weight = _parameter(name, weights[name], norm, dtype)
        norm.kernels = load.kernels if norm.weight.shape[0] % 8 == 0 else None
    load_deepseek(load, i, layer)
    if not is_moe_layer(load.config, i):
        layer.mlp.kernels = load.kernels


def layer_projections(
    config: ModelConfig, i: int
) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Layer ``i``'s projections: MHA's QKV or MLA's, the output, SwiGLU's or the shared
    experts' (ours -> its canonical weight and bias pieces)."""
    dense = not is_moe_layer(config, i)
    table = {
        ours: pieces
        for ours, pieces in PROJECTIONS.items()
        if (config.mla is None or ours != "qkv_proj") and (dense or not ours.startswith("mlp."))
    }
    table.update({ours: (names, ()) for ours, names in deepseek_projections(config, i).items()})
    return table


def _check_shape(name: str, tensor: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(want):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, model wants {tuple(want)}")


def _parameter(
    name: str, tensor: torch.Tensor, norm: nn.Module, dtype: torch.dtype
) -> nn.Parameter:
    _check_shape(name, tensor, tuple(norm.weight.shape))
    return nn.Parameter(tensor.detach().to(dtype).contiguous(), requires_grad=False)


def layer_parameters(config: ModelConfig) -> dict[str, str]:
    heads = HEAD_NORM_PARAMETERS if config.family.qk_norm else {}
    return {**LAYER_PARAMETERS, **heads, **deepseek_norms(config)}


def canonical_names(config: ModelConfig) -> set[str]:
    names = {"embed_tokens.weight", "norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        per_layer = [*layer_parameters(config).values(), *deepseek_names(config, i)]
        for weight_names, bias_names in layer_projections(config, i).values():
            per_layer.extend(weight_names)
            if config.attention_bias:
                per_layer.extend(bias_names)
        names.update(f"layers.{i}.{p}" for p in per_layer)
    return names
