"""Hugging Face folders: ``*.safetensors`` → canonical weights (``config.json`` is read by
``pages/sources.py``)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pagedkv.errors import UsageError
from pagedkv.model.config import ModelConfig

# Hugging Face tensor name → canonical name (see llama.py). Llama, Mistral, Qwen2 and Qwen3 agree.
HF_GLOBAL_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
HF_LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.q_proj.bias": "q_proj.bias",
    "self_attn.k_proj.bias": "k_proj.bias",
    "self_attn.v_proj.bias": "v_proj.bias",
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.q_norm.weight": "q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "k_norm.weight",
    "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
    # DeepSeek-V2/V3: the latent attention (``deepseek_weights.py``) and the experts
    "self_attn.q_a_proj.weight": "q_a_proj.weight",
    "self_attn.q_a_layernorm.weight": "q_a_norm.weight",
    "self_attn.q_b_proj.weight": "q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj.weight",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "kv_b_proj.weight",
    "mlp.gate.weight": "router.weight",
    "mlp.gate.e_score_correction_bias": "router.bias",
    "mlp.shared_experts.gate_proj.weight": "shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight": "shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight": "shared_experts.down_proj.weight",
}
# Present in some checkpoints, never needed: recomputed from the config.
HF_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_NAME = re.compile(r"^mlp\.experts\.(\d+)\.((?:gate|up|down)_proj\.weight)$")

ProgressCallback = Callable[[int, int], None]


def canonical_name(hf_name: str) -> str | None:
    """Canonical name of an HF tensor; ``None`` when it is ignored; ``ValueError`` if unknown."""
    if hf_name in HF_GLOBAL_NAMES:
        return HF_GLOBAL_NAMES[hf_name]
    if HF_IGNORED.match(hf_name):
        return None
    match = _LAYER_NAME.match(hf_name)
    if match and match.group(2) in HF_LAYER_NAMES:
        return f"layers.{match.group(1)}.{HF_LAYER_NAMES[match.group(2)]}"
    if match and (expert := _EXPERT_NAME.match(match.group(2))):
        return f"layers.{match.group(1)}.experts.{expert.group(1)}.{expert.group(2)}"
    raise UsageError(f"unexpected tensor {hf_name!r} in safetensors checkpoint")


def iter_hf_weights(
    folder: str | os.PathLike[str],
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    progress: ProgressCallback | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical name, tensor)`` from every ``*.safetensors`` file of ``folder``.

    A tied checkpoint that still stores ``lm_head.weight`` has it skipped (the model reuses the
    embedding), and so are the layers past an MLA model's last (DeepSeek-V3's multi-token
    prediction module, which decoding one token a step does not run). Yielded tensors are
    owned by the caller.
    """
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    done = 0
    for handle in handles:
        for hf_name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
            done += 1
            if config.mla is not None and _layer_index(hf_name) >= config.num_layers:
                continue
            name = canonical_name(hf_name)
            if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            yield name, handle.get_tensor(hf_name).to(dtype)
            if progress is not None:
                progress(done, total)


def _layer_index(hf_name: str) -> int:
    """The layer of a ``model.layers.{i}.`` tensor; -1 for the model's ends."""
    match = _LAYER_NAME.match(hf_name)
    return int(match.group(1)) if match else -1
