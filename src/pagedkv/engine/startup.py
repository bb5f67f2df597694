"""Engine start-up: load the model, resolve the block size, size the KV pool, and build the
allocator, scheduler and runner. Everything decided here is printed once (``startup_report``):
the block size used with the reason for every rewrite, and the page-format fingerprint."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.runner import ModelRunner
from pagedkv.kvcache.policies import Policy, build_allocator, get_policy
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import CausalLM
from pagedkv.model.loader import load_model
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.planner.constraints import BlockSizeResolution, PageFormat, resolve_block_size
from pagedkv.planner.layout import KVLayout
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.scheduler import Scheduler

DEFAULT_MAX_MODEL_LEN = 2048
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_KV_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class EngineParts:
    model_config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    policy: Policy
    layout: KVLayout
    resolution: BlockSizeResolution
    page_format: PageFormat
    max_model_len: int
    allocator: KVAllocator
    scheduler: Scheduler
    runner: ModelRunner
    startup_report: str


def kv_layout(config: ModelConfig, dtype: str) -> KVLayout:
    """The KV record layout of ``config`` (K and V per KV head, per layer) at ``dtype``."""
    return KVLayout(
        name=config.architecture,
        attention="mha",
        num_layers=config.num_layers,
        kv_dtype=_KV_DTYPE_NAMES[dtype],
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )


def build_parts(
    config: EngineConfig, loaded: tuple[ModelConfig, CausalLM, Tokenizer] | None = None
) -> EngineParts:
    """Build an engine's parts; ``loaded`` skips loading (an already built model)."""
    model_config, model, tokenizer = loaded or load_model(config.model, config.dtype)
    max_model_len = config.max_model_len or min(
        model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
    )
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's context of "
            f"{model_config.max_position_embeddings} tokens"
        )
    policy = get_policy(config.policy)
    layout = kv_layout(model_config, config.dtype)
    num_slots = config.kv_cache_memory_bytes // layout.record_bytes
    if policy.allocator == "reserved":
        # One region of max_model_len slots per sequence is the whole point of this baseline.
        requested, backend = max_model_len, "torch-sdpa-reserved"
    else:
        requested, backend = config.block_size or policy.block_size, "torch-sdpa"
    resolution = resolve_block_size(requested, backend, layout)
    block_size = resolution.block_size
    num_blocks = num_slots // block_size
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory of {config.kv_cache_memory_bytes} bytes holds {num_slots} tokens "
            f"({layout.record_bytes} bytes each): fewer than 2 blocks of {block_size}"
        )
    allocator = build_allocator(policy, num_blocks * block_size, max_model_len, block_size)
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        preemption=config.preemption,
    ).build(allocator)
    runner = ModelRunner(model, model_config, num_blocks, block_size, _TORCH_DTYPES[config.dtype])
    page_format = PageFormat.from_layout(layout, block_size)
    report = "\n".join(
        [
            f"pagedkv: policy {policy.name} ({policy.description})",
            f"pagedkv: {resolution.log_line()}",
            f"pagedkv: KV pool {num_blocks} blocks x {block_size} tokens = "
            f"{num_blocks * block_size} slots, {runner.kv_cache_bytes / 2**20:.1f} MiB "
            f"({layout.record_bytes} bytes per token); max_model_len {max_model_len}",
            "pagedkv: page format "
            + ", ".join(f"{k}={v}" for k, v in page_format.to_dict().items()),
        ]
    )
    return EngineParts(
        model_config,
        model,
        tokenizer,
        policy,
        layout,
        resolution,
        page_format,
        max_model_len,
        allocator,
        scheduler,
        runner,
        report,
    )
