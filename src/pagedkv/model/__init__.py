"""The model layer: configs, loaders (GGUF, safetensors), tokenizer, and the paged forward.

Public API the engine uses::

    config, model, tokenizer = load_model(path_or_none, dtype="float32")
    kv_caches = allocate_kv_caches(config.num_layers, num_blocks, block_size,
                                   config.num_kv_heads, config.head_dim, dtype)
    positions, meta = build_attention_metadata(block_tables, context_lens, new_counts, block_size)
    hidden = model(input_ids, positions, kv_caches, meta)   # [T, H]; writes the new K/V
    logits = model.compute_logits(hidden[rows])
"""

from pagedkv.model.attention import BACKEND_INFO
from pagedkv.model.attention_metadata import AttentionMetadata, build_attention_metadata
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import KVCache, allocate_kv_caches, copy_blocks
from pagedkv.model.llama import CausalLM
from pagedkv.model.loader import load_model
from pagedkv.model.tokenizer import Tokenizer

__all__ = [
    "BACKEND_INFO",
    "AttentionMetadata",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "Tokenizer",
    "allocate_kv_caches",
    "build_attention_metadata",
    "copy_blocks",
    "load_model",
]
