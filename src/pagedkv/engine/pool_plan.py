"""Start-up's first section, the pool's plan: everything that depends only on the model's
shape (its ``config.json`` or GGUF header) and the flags, decided and checked *before* the
weights load: the context, the policy, where and how the model runs (device, dtype, attention
backend, CUDA graphs), the block size (the backend's rule) and, for a given or CPU pool, its
blocks against the memory free."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine.card_memory import free_memory_bytes
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv.setup import host_tier_blocks
from pagedkv.engine.kv.store import check_store_policy
from pagedkv.engine.memory import (
    CPU_KV_CACHE_MEMORY_BYTES,
    check_pool_fits,
    check_swap_holds_a_block,
    fixed_pool_blocks,
)
from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy, get_policy
from pagedkv.model.config import ModelConfig
from pagedkv.model.device import Placement, resolve_placement
from pagedkv.model.shards import RankShard
from pagedkv.pages.backends import RULES
from pagedkv.pages.head_split import HeadSplit, rank_layout
from pagedkv.pages.kv_dtypes import get_kv_dtype
from pagedkv.pages.layout import KVLayout, layout_from_shape
from pagedkv.pages.page_format import PageFormat
from pagedkv.planner.constraints import BlockSizeResolution, resolve_block_size

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class PoolPlan:
    """What the model's shape and the flags decide before the weights load. ``num_blocks``:
    the pool's blocks, None where the card sizes it (a GPU without ``--kv-cache-memory``).
    Under tensor parallelism every rank's pool has these blocks of its own heads: ``layout``
    and ``page_format`` are rank 0's (``split`` says whose heads are whose)."""

    max_model_len: int
    policy: Policy
    placement: Placement
    layout: KVLayout
    resolution: BlockSizeResolution
    page_format: PageFormat
    num_blocks: int | None
    num_host_kv_blocks: int
    lines: list[str]
    split: HeadSplit


def plan_pool(config: EngineConfig, model_config: ModelConfig) -> PoolPlan:
    """Section 1, the pool's plan: the context, the policy, the placement, the block size (the
    backend's rule) and, for a given or CPU pool, its blocks, checked against the memory."""
    context = model_config.max_position_embeddings
    max_model_len = config.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > context:
        raise UsageError(
            f"max_model_len {max_model_len} exceeds the model's context of {context} tokens",
            param="max_model_len",
        )
    policy, placement = get_policy(config.policy), engine_placement(config)
    whole = layout_from_shape(model_config.model_shape(), get_kv_dtype(placement.dtype).name)
    split = tensor_parallel_split(config, model_config, placement)
    layout = rank_layout(whole, split.tp_size, model_config.num_heads)  # one rank's pages
    reserved = policy.allocator == "reserved"
    # Reserved: one region of max_model_len slots per sequence is the whole point of this
    # baseline, one block, which every backend reads (the Triton tiles gather through the table).
    requested = max_model_len if reserved else config.block_size or policy.block_size
    resolution = resolve_block_size(requested, placement.backend.name, layout)
    block_size = resolution.block_size
    if not reserved:  # the prefix match unit must divide the block size the kernel took
        policy = config.engine_policy(block_size)
    num_blocks = None
    if config.kv_cache_memory_bytes is not None or placement.device.type != "cuda":
        memory_bytes = config.kv_cache_memory_bytes or CPU_KV_CACHE_MEMORY_BYTES
        num_blocks = fixed_pool_blocks(memory_bytes, layout, block_size, reserved)
        pool_bytes = num_blocks * layout.block_bytes(block_size)
        if placement.device.type == "cpu":  # every rank's pool is in this machine's memory
            pool_bytes *= split.tp_size
        check_pool_fits(pool_bytes, free_memory_bytes(placement.device), placement.device.type)
    check_swap_holds_a_block(config.preemption_mode, config.swap_space_bytes, layout, block_size)
    num_host_kv_blocks = host_tier_blocks(config, policy, layout, block_size)
    check_store_policy(config, policy)
    lines = [placement.describe(), *([placement.backend_note] if placement.backend_note else [])]
    page_format = PageFormat.from_layout(whole, block_size).for_rank(split, 0)
    return PoolPlan(
        max_model_len,
        policy,
        placement,
        layout,
        resolution,
        page_format,
        num_blocks,
        num_host_kv_blocks,
        lines,
        split,
    )


def tensor_parallel_split(
    config: EngineConfig, model_config: ModelConfig, placement: Placement
) -> HeadSplit:
    """The model's heads over ``--tensor-parallel-size`` ranks, checked before the weights load
    (one ``UsageError`` line: heads, MLP rows or quantized blocks that do not split, an MLA
    model, GPUs too few)."""
    tp = config.tensor_parallel_size
    split = HeadSplit(tp, model_config.num_heads, model_config.num_kv_heads)
    RankShard.of(model_config, tp, 0, config.weights)  # the MLP's rows, quantized blocks
    device = placement.device
    if tp > 1 and device.type == "cuda":
        import torch

        first = device.index or 0
        if first + tp > torch.cuda.device_count():
            raise UsageError(
                f"--tensor-parallel-size {tp} from cuda:{first} needs {first + tp} GPUs, "
                f"{torch.cuda.device_count()} visible",
                "tensor_parallel_size",
            )
    return split


def engine_placement(config: EngineConfig) -> Placement:
    """The engine's device, dtype and attention backend. ``UsageError``: no such device, or
    CUDA graphs asked for without a GPU and the Triton backend."""
    placement = resolve_placement(config.device, config.dtype, config.attention_backend)
    if config.cuda_graphs and not graphs_possible(placement):
        recorded = " or ".join(r.name for r in RULES.values() if r.cuda_graphs)
        raise UsageError(
            f"--cuda-graphs needs --device cuda and the {recorded} attention backend",
            param="cuda_graphs",
        )
    return placement


def graphs_possible(placement: Placement) -> bool:
    """CUDA graphs replay decode steps on a GPU, of a backend whose steps can be recorded."""
    return placement.device.type == "cuda" and placement.backend.cuda_graphs


def graphs_wanted(config: EngineConfig, placement: Placement) -> bool:
    """``config.cuda_graphs``, or by default on wherever they can run (never under tensor
    parallelism: a graph would not hold the ranks' collectives)."""
    if config.tensor_parallel_size > 1:
        return False
    return graphs_possible(placement) if config.cuda_graphs is None else config.cuda_graphs
