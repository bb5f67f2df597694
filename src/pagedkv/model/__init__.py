"""The model layer: configs, loaders (GGUF, safetensors), tokenizer, and the paged forward.

Public API the engine uses::

    config, model, tokenizer = load_model(path_or_none, dtype="float32")
    page = PageFormat.from_layout(layout_from_shape(config.model_shape(), "fp32"), block_size)
    kv_caches = allocate_kv_caches(page, num_blocks)
    meta = AttentionMetadata(slot_mapping, block_tables, context_lens, query_start_loc)
    hidden = model(input_ids, positions, kv_caches, meta, block_size)  # [T, H]; writes K/V
    logits = model.compute_logits(hidden[rows])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_attributes

# Names resolved on first use (PEP 562), so that importing one torch-free module of this
# package (a router reads the request models and error shapes) does not import torch.
_LAZY = {
    "AttentionMetadata": "pagedkv.model.attention_metadata",
    "ModelConfig": "pagedkv.model.config",
    "KVCache": "pagedkv.model.kv_pool",
    "allocate_kv_caches": "pagedkv.model.kv_pool",
    "CausalLM": "pagedkv.model.llama",
    "load_model": "pagedkv.model.loader",
    "Tokenizer": "pagedkv.model.tokenizer",
}

if TYPE_CHECKING:
    from pagedkv.model.attention_metadata import AttentionMetadata
    from pagedkv.model.config import ModelConfig
    from pagedkv.model.kv_pool import KVCache, allocate_kv_caches
    from pagedkv.model.llama import CausalLM
    from pagedkv.model.loader import load_model
    from pagedkv.model.tokenizer import Tokenizer

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "Tokenizer",
    "allocate_kv_caches",
    "load_model",
]
