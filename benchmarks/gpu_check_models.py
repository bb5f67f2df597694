"""The models and workloads of the greedy and engine sections: the Llama-3-8B-shaped config
(and the dry run's tiny one) with random weights, pagedkv's and transformers' from the same
tensors, a tokenizer-free workload from the Azure trace, transformers ``generate`` as the
peer, and the dry run's stand-in CUDA graph."""

from __future__ import annotations

import csv
import itertools
import json
import random
import time
from pathlib import Path

import torch

# -- a Llama-shaped model with random weights ------------------------------------------------------


def llama3_8b_config():
    """Llama-3-8B's ``ModelConfig``: the shapes from the shipped preset, the rest of its
    config.json by hand (RoPE theta 500000 without the llama3 scaling: the weights are random)."""
    from pagedkv.model.config import ModelConfig

    preset = Path(__file__).resolve().parents[1] / "src/pagedkv/presets/llama-3-8b.json"
    p = json.loads(preset.read_text())
    return ModelConfig(
        architecture="llama", vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"], num_layers=p["num_hidden_layers"],
        num_heads=p["num_attention_heads"], num_kv_heads=p["num_key_value_heads"],
        head_dim=p["head_dim"], rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=p["max_position_embeddings"],
        tie_word_embeddings=p["tie_word_embeddings"], attention_bias=False,
    )  # fmt: skip


def tiny_llama_config():
    """The dry run's stand-in: 2 layers, 4 query and 2 KV heads of 32, a vocabulary of 512."""
    from pagedkv.model.config import ModelConfig

    return ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=512, tie_word_embeddings=False,
        attention_bias=False,
    )  # fmt: skip


def random_llama_weights(cfg, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """Canonical-named weights (``CausalLM.load_weights``'s names), made on ``device``: matrices
    N(0, 0.02^2), norms 1. Nothing is read from disk."""
    torch.manual_seed(seed)
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

    weights = {
        "embed_tokens.weight": matrix(cfg.vocab_size, hidden),
        "norm.weight": torch.ones(hidden, device=device, dtype=dtype),
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = matrix(cfg.vocab_size, hidden)
    for i in range(cfg.num_layers):
        layer = {
            "q_proj.weight": matrix(q_rows, hidden),
            "k_proj.weight": matrix(kv_rows, hidden),
            "v_proj.weight": matrix(kv_rows, hidden),
            "o_proj.weight": matrix(hidden, q_rows),
            "gate_proj.weight": matrix(inter, hidden),
            "up_proj.weight": matrix(inter, hidden),
            "down_proj.weight": matrix(hidden, inter),
            "input_layernorm.weight": torch.ones(hidden, device=device, dtype=dtype),
            "post_attention_layernorm.weight": torch.ones(hidden, device=device, dtype=dtype),
        }
        weights.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return weights


_HF_LAYER_NAMES = {
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}


def hf_llama(cfg, weights: dict, device: torch.device, dtype: torch.dtype):
    """transformers' ``LlamaForCausalLM`` of ``cfg`` holding ``weights``' own tensors (assigned,
    not copied: no second copy on the device), in eval mode."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    )  # fmt: skip
    state = {"model.embed_tokens.weight": weights["embed_tokens.weight"],
             "model.norm.weight": weights["norm.weight"],
             "lm_head.weight": weights.get("lm_head.weight", weights["embed_tokens.weight"])}  # fmt: skip
    for i in range(cfg.num_layers):
        for ours, theirs in _HF_LAYER_NAMES.items():
            state[f"model.layers.{i}.{theirs}"] = weights[f"layers.{i}.{ours}"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the model dtype, on the device: no fp32 detour
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def synthetic_tokenizer(vocab_size: int):
    """A valid pagedkv ``Tokenizer`` of exactly ``vocab_size`` ids for a model without one: the
    256 byte-level symbols, then strings of two and three of them (decoding any id gives
    text, as the engine's detokenizer needs); no merges, EOS the last id."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from pagedkv.model.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = itertools.chain(
        alphabet, ("".join(p) for n in (2, 3) for p in itertools.product(alphabet, repeat=n))
    )
    vocab = {w: i for i, w in zip(range(vocab_size), words, strict=False)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    eos = vocab_size - 1
    return Tokenizer(backend, chat_template=None, bos_token_id=None, eos_token_id=eos,
                     stop_token_ids=(eos,))  # fmt: skip


# -- workloads and peers ---------------------------------------------------------------------------


def trace_workload(path, count: int, vocab_size: int, max_prompt: int, max_output: int, seed=0):
    """The first ``count`` requests of an Azure trace CSV: prompts of its ContextTokens and
    outputs of its GeneratedTokens, each capped (and at least 1); prompt ids drawn at random
    (fixed seed, ids >= 256). Returns (prompt ids, output lengths)."""
    rng = random.Random(seed)
    ids, outs = [], []
    with open(path, newline="") as f:
        for row in itertools.islice(csv.DictReader(f), count):
            prompt = min(max(int(row["ContextTokens"]), 1), max_prompt)
            outs.append(min(max(int(row["GeneratedTokens"]), 1), max_output))
            ids.append([rng.randrange(256, vocab_size) for _ in range(prompt)])
    return ids, outs


def hf_generate(model, prompts, new_tokens, batch_size: int, pad_id: int, max_s: float):
    """transformers ``generate``, greedy, EOS ignored, in static left-padded batches of
    ``batch_size`` in order; a batch runs to its longest output (only the requested tokens
    count). Starts no batch that would end past ``max_s`` seconds if it took as long as the
    last one (the first always runs). Returns (seconds, useful tokens, requests run, the
    tokens of each request run)."""
    from transformers import GenerationConfig

    device = model.device
    elapsed, last, useful, done, tokens = 0.0, 0.0, 0, 0, []
    for start in range(0, len(prompts), batch_size):
        if elapsed + last > max_s:
            break
        chunk, outs = prompts[start : start + batch_size], new_tokens[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        cfg = GenerationConfig(max_new_tokens=max(outs), min_new_tokens=max(outs),
                               do_sample=False, pad_token_id=pad_id, eos_token_id=None)  # fmt: skip
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        _sync(device)
        last = time.perf_counter() - t0
        elapsed += last
        useful += sum(outs)
        done += len(chunk)
        tokens += [row[width : width + n].tolist() for row, n in zip(out, outs, strict=True)]
    return elapsed, useful, done, tokens


class ReplayedGraph:
    """The dry run's stand-in for ``torch.cuda.CUDAGraph`` (as the tests have it): ``record``
    runs the step once and keeps it, ``replay`` reruns it into the recorded output. Everything
    of ``DecodeGraphs`` runs but the recording itself."""

    def record(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self):
        with torch.inference_mode():
            self.out.copy_(self.fn())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
