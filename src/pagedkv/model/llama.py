"""The decoder of every family (Llama, Mistral, Qwen2, Qwen3, DeepSeek-V2/V3) over a paged KV
cache.

Usage by the engine (one call per step)::

    model = build_model(config)                  # on "meta"; then model.load_weights(...)
    page = PageFormat.from_layout(layout_from_shape(config.model_shape(), "fp32"), block_size)
    kv = allocate_kv_caches(page, num_blocks)
    hidden = model(input_ids, positions, kv, AttentionMetadata(...), block_size)  # [T, H]
    logits = model.compute_logits(hidden[last_token_rows])                        # [N, V] fp32

Weights arrive under *canonical* names (``layers.{i}.q_proj.weight`` ...); loaders translate
file names into them, ``load_weights`` fuses Q/K/V and gate/up into single matmuls and stores
every projection on pagedkv's kernels (``native/projection.py``), in torch
(``projection.Projection``) or quantized (``quant.py``). The layer itself: ``decoder_layer.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pagedkv.model import native
from pagedkv.model.attention_backend import AttentionBackend, StepOps, make_backend
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.config import ModelConfig
from pagedkv.model.decoder_layer import DecoderLayer
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.layers import RMSNorm, RotaryEmbedding
from pagedkv.model.mla.rope import mla_rotary
from pagedkv.model.native.projection import NativeProjection, native_factory
from pagedkv.model.parallel import VocabShard
from pagedkv.model.projection import Projection
from pagedkv.model.weights import Load, ProjectionFactory, check_names, load_ends, load_layer
from pagedkv.pages.backends import resolve_backend


class CausalLM(nn.Module):
    """Decoder-only LM. Parameters start uninitialised-by-contract: call ``load_weights``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # None: the embedding rows are read from the (tied) lm_head's columns. An empty weight:
        # nn.Embedding's own init goes through torch._dynamo's import (1.6 s of a 3.4 s load).
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module = Projection(config.hidden_size, config.vocab_size)
        # Computed, not loaded: on the CPU even inside build_model's meta device (ops on meta
        # tensors run torch's reference implementations, which import torch._dynamo: ~1 s).
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
            if config.mla is not None:  # the rotary dims only, DeepSeek's YaRN
                self.rotary = mla_rotary(config.mla, config.rope_theta, config.yarn)
        # One layer's pool rows: K and V heads, or MLA's one latent record (``kv_pool.py``).
        self.pool_row = (config.num_kv_heads, config.head_dim)
        if config.mla is not None:
            self.pool_row = (1, config.mla.record_width)
        self.weights_report = ""  # how the projections compute, set by the loader
        self.kernels = None  # native.kernels() when load_weights put the weights on them (fp32)
        self._default: AttentionBackend | None = None  # ``default_backend``, built once loaded
        # Tensor parallelism (``parallel.py``): this rank's vocabulary rows; None = all of them.
        self.vocab_shard: VocabShard | None = None
        # The digest of the weights as read, whatever the split (``shards.WeightsDigest``): the
        # model identity where the loader set it.
        self.weights_digest: str | None = None
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        """Where the weights and activations live (``load_weights``'s ``device``)."""
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations (and of the KV written by the model)."""
        return self.norm.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_shard is not None:  # this rank's rows, summed over the ranks
            return self.vocab_shard.embed(input_ids, self.embed_rows)
        return self.embed_rows(input_ids)

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` rows of the embedding held here (all of it at one rank)."""
        if self.embed_tokens is None and isinstance(self.lm_head, NativeProjection):
            return self.lm_head.tied_rows(input_ids)  # tied: row i of its [vocab, hidden]
        if self.embed_tokens is None:  # tied: column i of lm_head's [hidden, vocab] is row i
            # Contiguous: a transposed [T, H] would pass its layout on to every residual add
            # (TensorIterator keeps it), and each RMSNorm would copy it back (61 copies a step).
            return self.lm_head.weight_t.index_select(1, input_ids).t().contiguous()
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        block_size: int | None = None,
        plan: StepOps | None = None,
    ) -> torch.Tensor:
        """Run the new tokens of one step; returns the final-normed hidden states ``[T, H]``.

        ``input_ids``/``positions``: int64 ``[T]`` in batch order (``query_start_loc``); the
        position of new token i of a sequence must be ``context_len - new_tokens + i`` (RoPE
        reads ``positions``, the causal mask reads the metadata; they must agree).
        ``kv_caches``: one ``(k, v)`` pair per layer (MLA: ``(latents,)``); the new tokens' K/V
        are written into their slots (mutated in place). ``block_size`` defaults to the caches' dimension 1. ``plan``:
        the step's ops on the engine's backend (``attention_backend.py``: the runner makes
        them, or a CUDA graph over its buffers); None = ``default_backend``'s.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"need {self.config.num_layers} KV caches, got {len(kv_caches)}")
        want = self.pool_row
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
        if plan is None:
            plan = self.default_backend().plan(attn_metadata, kv_caches, block_size)
        positions = positions.to(self.device, non_blocking=True)  # host tensors cross once
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        hidden = self.embed(input_ids.to(self.device, non_blocking=True))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, plan)
        return self.norm(hidden)

    def default_backend(self) -> AttentionBackend:
        """The backend a forward without a plan runs on: its device's default
        (``pages/backends.py``), built on first use after the weights are loaded."""
        if self._default is None:
            rule, _ = resolve_backend(None, self.device.type)
            self._default = make_backend(rule, self, self.device)
        return self._default

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of selected hidden rows (usually each sequence's last); a
        tensor-parallel rank's are gathered onto rank 0 (every rank must call it)."""
        if self.vocab_shard is not None:
            return self.vocab_shard.logits(hidden, self.lm_head)
        return self.lm_head(hidden).float()

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        make_projection: ProjectionFactory | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Set every parameter from canonical-named tensors (converted to ``dtype``, moved to
        ``device``: pagedkv's C kernels are CPU-only, a GPU computes with torch ops).

        Works on a model built on the ``meta`` device (``build_model``): modules and parameters
        are replaced, not copied into. Raises ``ValueError`` naming missing, unexpected or
        mis-shaped tensors. ``make_projection`` (name, fused weight ``[out, in]``, bias) builds
        each projection, the lm_head included; None keeps them unquantized in ``dtype``: in fp32
        on pagedkv's compiled kernels where they load (``native.py``), else ``Projection``. The
        caller hands the tensors over (they may be kept or freed).
        """
        device = torch.device(device)
        on_cpu = device.type == "cpu"
        kernels = self.kernels = native.kernels() if dtype == torch.float32 and on_cpu else None
        self._default = None  # a backend built before took the old weights' addresses
        if not on_cpu:  # on the device in the model dtype (4x less to move than fp32 for bf16)
            if make_projection is not None:
                raise ValueError("quantized weights run on the CPU only")
            weights = {
                k: v if k == "rope_freqs.weight" else v.to(device=device, dtype=dtype)
                for k, v in weights.items()
            }
        if make_projection is None and kernels is not None:
            make_projection = native_factory()
        check_names(self.config, weights)
        load = Load(self.config, weights, dtype, make_projection, kernels)
        load_ends(self, load)
        for i, layer in enumerate(self.layers):
            load_layer(load, i, layer)
        if "rope_freqs.weight" in weights:
            self.rotary.scale_frequencies(weights["rope_freqs.weight"])
        self.rotary.to(device)


# The explicit architecture → model class table. All supported families share one forward.
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "mistral": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "deepseek_v2": CausalLM,
    "deepseek_v3": CausalLM,
    "deepseek2": CausalLM,
}


def build_model(config: ModelConfig) -> CausalLM:
    """An empty model of the class ``config.architecture`` names, parameters on ``meta``.

    Skipping random initialisation saves seconds; ``load_weights`` then sets every parameter.
    """
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    return model
