"""Multi-head latent attention's shape facts (DeepSeek-V2/V3): the dims of the latent attention,
DeepSeek's YaRN RoPE scaling with its mscale, and the rule that decides how a prefill chunk
attends. Pure Python, no torch: ``pages/sources.py`` reads them from a ``config.json`` or a GGUF
header, the model builds its layers from them, and the rule is one function anyone may price.

An MLA layer caches one *latent record* per token: the RMS-normalised compressed KV
(``kv_lora_rank`` values) and the rotated shared key ``k_pe`` (``qk_rope_head_dim``), for every
head at once (``pages/layout.py`` owns its bytes). Keys and values of ``num_heads`` heads are
``kv_b_proj`` of the latent (``qk_nope_head_dim`` key and ``v_head_dim`` value dims per head),
the key's rotary part the shared ``k_pe``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.pages.moe_shape import MoEShape

# The rope types of a config.json that mean DeepSeek's YaRN (older checkpoints spell it so).
YARN_TYPES = ("yarn", "deepseek_yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (paper eq. 21): ``0.1 * mscale * ln(scale) + 1``, 1 when
    the context is not stretched (``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnRopeScaling:
    """DeepSeek's YaRN: frequencies between ``beta_slow`` and ``beta_fast`` rotations over the
    original context blended from interpolated (``/ factor``) to kept; cos and sin scaled by
    ``attention_factor``; the softmax scale multiplied by ``yarn_mscale(factor,
    mscale_all_dim)`` squared (``softmax_mscale``). As transformers' ``_compute_yarn_parameters``
    and ``yarn_apply_mscale``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: unset
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: from mscale / mscale_all_dim
    truncate: bool = True

    def __post_init__(self) -> None:
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise UsageError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise UsageError(
                "rope_scaling.original_max_position_embeddings must be >= 1, "
                f"got {self.original_max_position_embeddings}"
            )
        if not self.beta_fast > self.beta_slow > 0:
            raise UsageError(
                f"rope_scaling needs beta_fast > beta_slow > 0, got {self.beta_fast}, "
                f"{self.beta_slow}"
            )

    @classmethod
    def from_dict(cls, rope: Mapping[str, Any], max_position_embeddings: int) -> YarnRopeScaling:
        """From a config.json's ``rope_scaling`` / ``rope_parameters``; ``UsageError`` naming
        the key that is missing or malformed."""
        try:
            original = int(rope["original_max_position_embeddings"])
            factor = rope.get("factor")
            factor = max_position_embeddings / original if factor is None else float(factor)
            given = rope.get("attention_factor")
            return cls(
                factor=factor,
                original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast") or 32.0),
                beta_slow=float(rope.get("beta_slow") or 1.0),
                mscale=float(rope.get("mscale") or 0.0),
                mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                attention_factor=None if given is None else float(given),
                truncate=bool(rope.get("truncate", True)),
            )
        except KeyError as exc:
            raise UsageError(f"yarn rope_scaling lacks the key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise UsageError(f"yarn rope_scaling: {exc}") from None

    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (so both q_pe and k_pe): transformers'
        ``attention_factor``; 1 for DeepSeek's own configs (mscale == mscale_all_dim)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """The factor of the attention's softmax scale (its non-rotary dims too)."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclass(frozen=True)
class MLADims:
    """The dims of one MLA layer; validated on construction (``UsageError`` naming the
    config.json key). ``q_lora_rank`` None: queries come from one ``q_proj`` of the hidden
    state (DeepSeek-V2-Lite); else from ``q_b_proj(norm(q_a_proj(x)))``. ``rope_interleaved``:
    the checkpoint's rotary dims pair (0, 1), (2, 3) ... (DeepSeek's layout; the loader
    reorders the rows once, so the half-split rotation applies)."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool = True

    def __post_init__(self) -> None:
        for key in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{key} must be an integer >= 1, got {value!r}")
        rope = self.qk_rope_head_dim
        if not isinstance(rope, int) or rope < 2 or rope % 2:
            raise UsageError(f"qk_rope_head_dim must be an even integer >= 2, got {rope!r}")
        q_rank = self.q_lora_rank
        if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
            raise UsageError(f"q_lora_rank must be null or an integer >= 1, got {q_rank!r}")

    @property
    def qk_head_dim(self) -> int:
        """Width of one query (and decompressed key) head: its nope and rope dims."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def record_width(self) -> int:
        """Values of one latent record (per token and layer): the compressed KV, then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def decompress_prefill(self, new_tokens: int, context_tokens: int) -> bool:
        """Whether a chunk of ``new_tokens`` queries over ``context_tokens`` keys (its cached
        prefix and itself) attends *decompressed* (``kv_b_proj`` of every latent of the context
        into per-head K and V, then ordinary attention) rather than *absorbed* (queries carried
        into latent space through W_UK, attention over the latents, the output carried back
        through W_UV): the one with fewer multiply-adds. With n new tokens, L keys, H heads, R
        the latent rank, Dn/Dr/Dv the nope/rope/value dims (H cancels)::

            decompressed  L R (Dn + Dv)  +  n L (Dn + Dr + Dv)
            absorbed      n R (Dn + Dv)  +  n L (2 R + Dr)

        A prompt without a cached prefix (n = L) always decompresses; one decode token (n = 1)
        always runs absorbed; a chunk over a long cached prefix runs absorbed until
        n > L R (Dn + Dv) / (R (Dn + Dv) + L (2 R - Dn - Dv)) (DeepSeek-V2's dims: ~170 tokens
        for a long prefix). Decode rows are absorbed on every backend whatever this says.
        """
        r, dr = self.kv_lora_rank, self.qk_rope_head_dim
        dn, dv = self.qk_nope_head_dim, self.v_head_dim
        n, length = new_tokens, context_tokens
        decompressed = length * r * (dn + dv) + n * length * (dn + dr + dv)
        absorbed = n * r * (dn + dv) + n * length * (2 * r + dr)
        return decompressed <= absorbed


def mla_hf_fields(
    config: Mapping[str, Any], rope: Mapping[str, Any], common: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``ModelShape`` fields of an MLA ``config.json`` beyond ``common`` (the fields every
    config gives, ``pages/sources.py``): the record's dims, the latent attention's other dims
    (a query head's width as ``head_dim``: its nope and rope dims), DeepSeek's YaRN from
    ``rope`` (the config's ``rope_scaling`` / ``rope_parameters``), the experts, and the
    parameter count when the config does not give it. The record's dims must be integers;
    the others are checked by ``MLADims`` and ``MoEShape`` when the model is built."""

    def get(key: str) -> Any:
        return config.get(key)

    moe = MoEShape.from_hf(config, common["architecture"])
    fields: dict[str, Any] = {
        "kv_lora_rank": _count(get("kv_lora_rank"), "kv_lora_rank"),
        "qk_rope_head_dim": _count(get("qk_rope_head_dim") or 0, "qk_rope_head_dim"),
        "q_lora_rank": get("q_lora_rank"),
        "qk_nope_head_dim": get("qk_nope_head_dim") or 0,
        "v_head_dim": get("v_head_dim") or 0,
        # DeepSeek's rotary dims pair adjacently (V2 always; V3 unless rope_interleave false)
        "rope_interleaved": bool(config.get("rope_interleave", True)),
        "moe": moe,
    }
    if get("qk_nope_head_dim") and get("qk_rope_head_dim"):
        fields["head_dim"] = int(get("qk_nope_head_dim")) + int(get("qk_rope_head_dim"))
    if common["rope_scaling_type"] in YARN_TYPES:
        fields["rope_scaling_type"] = "yarn"
        fields["yarn"] = YarnRopeScaling.from_dict(rope, common["max_context_tokens"])
    if common["num_params"] is None:
        fields["num_params"] = estimate_mla_num_params(config, moe)
    return fields


def _count(value: Any, key: str) -> int:
    """A count from a config.json: an integer (2.0 is fine, 2.5 or "2" is not) >= 0."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < 0:
        raise UsageError(f"{key} must be an integer >= 0, got {value!r}")
    return int(value)


def estimate_mla_num_params(config: Mapping[str, Any], moe: MoEShape | None) -> int | None:
    """Parameter count of a DeepSeek-style config (None if a needed key is missing): the
    embeddings (+ an untied head), per layer the latent attention (queries with or without
    their low rank, the KV compression and its decompression, the output, two latent norms),
    a dense MLP or every routed and shared expert with the router, two RMSNorms; the final
    norm. ``moe``: the config's ``MoEShape`` or None."""
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        rank, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
        nope, v_dim = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
        vocab, layers = int(config["vocab_size"]), int(config["num_hidden_layers"])
        dense = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError):
        return None
    q_rank = config.get("q_lora_rank")
    q_out = heads * (nope + rope)
    queries = hidden * q_out if not q_rank else hidden * q_rank + q_rank + q_rank * q_out
    attention = queries + hidden * (rank + rope) + rank + rank * heads * (nope + v_dim)
    attention += heads * v_dim * hidden
    total = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2) + hidden
    for index in range(layers):
        if moe is not None and moe.is_moe_layer(index):
            width = moe.expert_intermediate_size
            experts = (moe.num_experts + moe.num_shared_experts) * 3 * hidden * width
            mlp = experts + moe.num_experts * (hidden + 1)  # the router and its bias
        else:
            mlp = 3 * hidden * dense
        total += attention + mlp + 2 * hidden
    return total
