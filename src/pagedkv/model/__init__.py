"""The model layer: configs, loaders (GGUF, safetensors), tokenizer, and the paged forward.

Public API the engine uses::

    config, model, tokenizer = load_model(path_or_none, dtype="float32")
    kv_caches = allocate_kv_caches(config.num_layers, num_blocks, block_size,
                                   config.num_kv_heads, config.head_dim, dtype)
    meta = AttentionMetadata(slot_mapping, block_tables, context_lens, query_start_loc)
    hidden = model(input_ids, positions, kv_caches, meta, block_size)  # [T, H]; writes K/V
    logits = model.compute_logits(hidden[rows])
"""

from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import KVCache, allocate_kv_caches, copy_blocks
from pagedkv.model.llama import CausalLM
from pagedkv.model.loader import load_model
from pagedkv.model.tokenizer import Tokenizer

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "Tokenizer",
    "allocate_kv_caches",
    "copy_blocks",
    "load_model",
]
