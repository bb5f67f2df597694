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
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def hf_config(arch: str):
    """A transformers config of ``arch`` exercising that family's particulars."""
    import transformers

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
            **COMMON, head_dim=16, tie_word_embeddings=False, rope_parameters=rope
        )
    if arch == "qwen2":  # q/k/v bias, tied embeddings
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**COMMON, tie_word_embeddings=False)
    raise ValueError(arch)


def make_tiny_model(arch: str, folder: Path, seed: int = 0):
    """Save a random ``arch`` model to ``folder``; returns the transformers model (fp32, eval).

    Every parameter (norms and biases too, which transformers initialises to 1 and 0) is drawn
    at random so that each one influences the logits.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
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
