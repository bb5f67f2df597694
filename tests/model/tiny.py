"""Tiny random Hugging Face checkpoints (config.json + safetensors + tokenizer.json) for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB_SIZE = 300  # 256 byte tokens, 2 specials, and some ids no text maps to
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=256,
    eos_token_id=257,
)
# DeepSeek's latent attention and experts, tiny: 3 layers (the first dense, two of 8 experts,
# 2 per token, in 2 groups), a latent of 32 + 8 rope dims, heads of 16 + 8 query dims and 16
# value dims; YaRN stretching a 32-token original context 4x.
DEEPSEEK = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def tiny_model_config():
    """The tiny llama's ``ModelConfig``, built by hand (no file, no weights): 2 layers, 4 query
    and 2 KV heads of 16, so 512 bytes of fp32 K and V per token."""
    from pagedkv.model.config import ModelConfig

    return ModelConfig(
        architecture="llama",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=False,
    )


def hf_config(arch: str, context_len: int | None = None, **overrides):
    """A transformers config of ``arch`` exercising that family's particulars (``context_len``
    replaces the usual ``max_position_embeddings``; ``overrides`` replace ``COMMON``'s
    fields, e.g. ``num_key_value_heads=1``)."""
    import transformers

    common = {**COMMON, **overrides}
    if context_len is not None:
        common["max_position_embeddings"] = context_len

    if arch == "llama":  # untied head, llama3 RoPE scaling, explicit head_dim
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        return transformers.LlamaConfig(
            **common, head_dim=16, tie_word_embeddings=False, rope_parameters=rope
        )
    if arch == "qwen2":  # q/k/v bias, tied embeddings
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=False)
    if arch == "qwen3":  # per-head q/k RMSNorm; head_dim apart from hidden / heads (64 / 4)
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch.startswith("deepseek"):
        return _deepseek_config(arch, common)
    raise ValueError(arch)


def _deepseek_config(arch: str, common: dict):
    """V2: queries without a low rank, softmax routing limited to the best group, routed
    weights scaled by 1.5, one shared expert, YaRN with DeepSeek's equal mscales. V3: queries
    through a low rank of 24, sigmoid routing with the score bias over the groups' two best,
    normalised and scaled by 2.5, two shared experts, YaRN with mscale apart from mscale_all_dim
    (cos and sin scaled too)."""
    import transformers

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
            "beta_slow": 1, "original_max_position_embeddings": 32, "mscale": 0.707,
            "mscale_all_dim": 0.707}  # fmt: skip
    fields = {**common, **DEEPSEEK}
    if arch == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **fields, q_lora_rank=None, topk_method="group_limited_greedy",
            routed_scaling_factor=1.5, n_shared_experts=1, rope_parameters=yarn,
        )  # fmt: skip
    if arch == "deepseek_v3":
        yarn = dict(yarn, mscale=1.0)
        return transformers.DeepseekV3Config(
            **fields, q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True,
            n_shared_experts=2, rope_parameters=yarn,
        )  # fmt: skip
    raise ValueError(arch)


def make_tiny_model(
    arch: str,
    folder: Path,
    seed: int = 0,
    context_len: int | None = None,
    config=None,
    **overrides,
):
    """Save a random ``arch`` model (of ``config``, a transformers config, when given; else
    ``hf_config``'s with ``overrides``) to ``folder``; returns the transformers model (fp32,
    eval).

    Every parameter (norms and biases too, which transformers initialises to 1 and 0) is drawn
    at random so that each one influences the logits.
    """
    import transformers

    torch.manual_seed(seed)
    if config is None:
        config = hf_config(arch, context_len, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's router score bias
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return model


def _write_tokenizer(folder: Path) -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def add_tokenizer(writer) -> None:
    """The tiny byte-level tokenizer as GGUF metadata (llama.cpp's "gpt2" model)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["<s>", "</s>"] + [f"<unused{i}>" for i in range(VOCAB_SIZE - 258)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * (len(tokens) - 256))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template(CHAT_TEMPLATE)


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The Q/K row order llama.cpp's converter writes for Llama models: within each head, rows
    i and i + d/2 become the adjacent pair (2i, 2i + 1). Written as a loop, on purpose."""
    d = w.shape[0] // num_heads
    out = torch.empty_like(w)
    for h in range(num_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


# transformers name (after "model.layers.{i}.") → llama.cpp tensor name (after "blk.{i}.").
_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(hf_model, arch: str, path: Path) -> None:
    """Write ``hf_model`` as an F32 GGUF the way llama.cpp's converter lays it out: Llama Q/K
    rows permuted, tied embeddings without ``output.weight``, llama3 RoPE as ``rope_freqs``."""
    import gguf
    import numpy as np
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    add_tokenizer(writer)

    permute = arch == "llama"
    for name, tensor in hf_model.state_dict().items():
        t = tensor.detach().float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, index, rest = name.split(".", 3)
            out = f"blk.{index}.{_TO_GGUF[rest]}"
            if permute and rest.startswith("self_attn.q_proj"):
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif permute and rest.startswith("self_attn.k_proj"):
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
        writer.add_tensor(out, np.ascontiguousarray(t.numpy()))
    if cfg.rope_parameters.get("rope_type") == "llama3":
        # transformers' own llama3 frequencies against its defaults: llama.cpp's factors.
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        plain = 1.0 / (
            cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2) / head_dim)
        )
        writer.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
