"""A tiny DeepSeek checkpoint (from ``tiny.make_tiny_model``) written as a GGUF ``deepseek2``
file the way llama.cpp's converter (``convert_hf_to_gguf.py``, ``DeepseekV2Model``) writes one:
the tensor names from gguf-py's own map for the architecture (``gguf.get_tensor_name_map``),
the routed experts stacked per layer, ``kv_b_proj`` whole (older converters) or split per head
into ``attn_k_b`` (transposed) and ``attn_v_b`` (newer ones, which then spend ``key_length`` /
``value_length`` on the latent's widths and add the ``*_mla`` keys), the score bias renamed as
the converter does, YaRN as ``rope.scaling.*``. ``drop``: metadata keys to leave out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.model.tiny import add_tokenizer


def write_deepseek_gguf(hf_model, path: Path, split_kv_b: bool, drop: tuple[str, ...] = ()):
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    _metadata(writer, cfg, split_kv_b, drop)
    add_tokenizer(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        t = tensor.detach().float()
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' stacks [E, 2I, H]
            gate, up = t.chunk(2, dim=1)
            _add(writer, names, name.replace("gate_up_proj", "gate_proj.weight"), gate)
            _add(writer, names, name.replace("gate_up_proj", "up_proj.weight"), up)
            continue
        if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            _add(writer, names, name + ".weight", t)
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
            kv_b = t.view(heads, nope + cfg.v_head_dim, t.shape[-1])
            k_b, v_b = kv_b[:, :nope].transpose(1, 2), kv_b[:, nope:]
            for half, data in (("k_b_proj", k_b), ("v_b_proj", v_b)):
                _add(writer, names, name.replace("kv_b_proj", half), data)
            continue
        _add(writer, names, name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer, names, hf_name: str, tensor: torch.Tensor) -> None:
    out = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert out is not None, hf_name
    writer.add_tensor(out, np.ascontiguousarray(tensor.numpy()))


def _metadata(writer, cfg, split_kv_b: bool, drop: tuple[str, ...]) -> None:
    import gguf

    rope, keys = cfg.rope_parameters, {}
    keys["block_count"] = cfg.num_hidden_layers
    keys["context_length"] = cfg.max_position_embeddings
    keys["embedding_length"] = cfg.hidden_size
    keys["feed_forward_length"] = cfg.intermediate_size
    keys["head_count"] = cfg.num_attention_heads
    keys["head_count_kv"] = 1  # the converter's MQA view of MLA
    keys["layer_norm_rms_eps"] = cfg.rms_norm_eps
    keys["rope_freq_base"] = rope["rope_theta"]
    keys["vocab_size"] = cfg.vocab_size
    keys["leading_dense_block_count"] = cfg.first_k_dense_replace
    if cfg.q_lora_rank:
        keys["q_lora_rank"] = cfg.q_lora_rank
    keys["kv_lora_rank"] = cfg.kv_lora_rank
    qk, rank = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if split_kv_b:
        keys["key_length"], keys["value_length"] = rank + cfg.qk_rope_head_dim, rank
        keys["key_length_mla"], keys["value_length_mla"] = qk, cfg.v_head_dim
    else:
        keys["key_length"], keys["value_length"] = qk, cfg.v_head_dim
    keys["expert_feed_forward_length"] = cfg.moe_intermediate_size
    keys["expert_count"] = cfg.n_routed_experts
    keys["expert_used_count"] = cfg.num_experts_per_tok
    keys["expert_shared_count"] = cfg.n_shared_experts
    keys["expert_weights_scale"] = cfg.routed_scaling_factor
    keys["expert_weights_norm"] = bool(getattr(cfg, "norm_topk_prob", False))
    v3 = cfg.model_type == "deepseek_v3"
    gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    keys["expert_gating_func"] = gating
    keys["expert_group_count"], keys["expert_group_used_count"] = cfg.n_group, cfg.topk_group
    keys["rope_dimension_count"] = cfg.qk_rope_head_dim
    keys["rope_scaling_type"] = gguf.RopeScalingType.YARN
    keys["rope_scaling_factor"] = rope["factor"]
    keys["rope_scaling_orig_ctx_len"] = rope["original_max_position_embeddings"]
    keys["rope_scaling_yarn_log_mul"] = 0.1 * rope["mscale_all_dim"]
    for key, value in keys.items():
        if key not in drop:
            getattr(writer, f"add_{key}")(value)
