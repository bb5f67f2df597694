"""Engine start-up: read the model's shape, resolve the block size, size the KV pool, build the
allocator and scheduler, then load the weights and build the runner. Everything decided here is printed once (``startup_report``):
the block size used with the reason for every rewrite, and the page-format fingerprint."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.card_memory import (
    card_start,
    free_memory_bytes,
    measure_card,
    profile_peak_bytes,
)
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv.events import EngineKVEvents, new_instance_id, open_kv_events
from pagedkv.engine.kv.identity import model_identity
from pagedkv.engine.kv.setup import attach_tiers, host_tier_blocks
from pagedkv.engine.kv.store import check_store_policy, store_tiers
from pagedkv.engine.memory import (
    CPU_KV_CACHE_MEMORY_BYTES,
    check_fits_one_sequence,
    check_pool_fits,
    fixed_pool_blocks,
    kv_bytes_from_card,
)
from pagedkv.engine.runner import ModelRunner
from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy, build_allocator, get_policy
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvstore.tier import StoreTier
from pagedkv.model.attention_backend import backend_rule, make_backend
from pagedkv.model.config import ModelConfig
from pagedkv.model.device import Placement, make_current, resolve_placement
from pagedkv.model.llama import CausalLM
from pagedkv.model.loader import load_model, read_model_shape
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.pages.kv_dtypes import get_kv_dtype
from pagedkv.pages.layout import KVLayout, layout_from_shape
from pagedkv.pages.page_format import PageFormat
from pagedkv.planner.constraints import BlockSizeResolution, resolve_block_size
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.scheduler import Scheduler

DEFAULT_MAX_MODEL_LEN = 2048


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
    # KV events (``--kv-events``; None = off): ``LLMEngine.step`` calls ``after_step``.
    kv_events: EngineKVEvents | None = None
    instance_id: str = field(default_factory=new_instance_id)  # fresh per engine
    kv_store: StoreTier | None = None  # the shared store tier (``--kv-store``; None = off)
    placement: Placement | None = None  # device, dtype and attention backend (start-up's)

    @property
    def model_identity(self) -> str:
        """``kv/identity.model_identity`` of the loaded weights (computed on first use, then
        remembered per model): the store namespace, ``/pagedkv/info`` and the P/D pair."""
        return model_identity(self.model)


def build_parts(
    config: EngineConfig, loaded: tuple[ModelConfig, CausalLM, Tokenizer] | None = None
) -> EngineParts:
    """Build an engine's parts; ``loaded`` skips loading (an already built model).

    Everything that depends only on the model's shape (its ``config.json`` or GGUF header) is
    decided and checked *before* the 10-25 s weight load: a ``max_model_len`` beyond the
    model's context or a ``kv_cache_memory`` too small for the pool is a ``UsageError`` at once.
    """
    model_config = loaded[0] if loaded else ModelConfig.from_shape(read_model_shape(config.model))
    max_model_len = config.max_model_len or min(
        model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
    )
    if max_model_len > model_config.max_position_embeddings:
        raise UsageError(
            f"max_model_len {max_model_len} exceeds the model's context of "
            f"{model_config.max_position_embeddings} tokens",
            param="max_model_len",
        )
    policy = get_policy(config.policy)
    placement = engine_placement(config)
    notes: list[str] = []
    layout = layout_from_shape(model_config.model_shape(), get_kv_dtype(placement.dtype).name)
    reserved = policy.allocator == "reserved"
    rule = backend_rule(placement.attention_backend, placement.device)
    # Reserved: one region of max_model_len slots per sequence is the whole point of this
    # baseline, one block, which every backend reads (the Triton tiles gather through the table).
    requested = max_model_len if reserved else config.block_size or policy.block_size
    resolution = resolve_block_size(requested, rule.name, layout)
    block_size = resolution.block_size
    if not reserved:  # the prefix match unit must divide the block size the kernel took
        policy = config.engine_policy(block_size)
    card_sized = config.kv_cache_memory_bytes is None and placement.device.type == "cuda"
    if not card_sized:  # a fixed pool is checked before the weights load
        memory_bytes = config.kv_cache_memory_bytes or CPU_KV_CACHE_MEMORY_BYTES
        num_blocks = fixed_pool_blocks(memory_bytes, layout, block_size, reserved)
        pool_bytes = num_blocks * layout.block_bytes(block_size)
        check_pool_fits(pool_bytes, free_memory_bytes(placement.device), placement.device.type)
    check_swap_space(config, layout, block_size)
    num_host_kv_blocks = host_tier_blocks(config, policy, layout, block_size)
    check_store_policy(config, policy)
    make_current(placement.device)
    start = card_start(placement.device) if card_sized else None
    if loaded is None:
        loaded = load_model(
            config.model, placement.dtype, weights=config.weights, device=placement.device
        )
    _, model, tokenizer = loaded
    if model is not None and model.device != placement.device:  # None: tests of the sizing
        raise UsageError(f"the model is on {model.device}, the engine on {placement.device}")
    backend = None if model is None else make_backend(rule.name, model, placement.device)
    page_format = PageFormat.from_layout(layout, block_size)
    if start is not None:

        def peak() -> int:
            return profile_peak_bytes(model, backend, page_format, config.max_num_batched_tokens,
                                      max_model_len, config.max_num_seqs)  # fmt: skip

        size = kv_bytes_from_card(
            measure_card(placement.device, start, peak), config.gpu_memory_utilization
        )
        num_blocks = size.kv_bytes // layout.block_bytes(block_size)
        # The allocator keeps one block back (the null block that pads block tables).
        notes.append(check_fits_one_sequence(size, num_blocks - 1, block_size, max_model_len))
    allocator = build_allocator(policy, num_blocks * block_size, max_model_len, block_size)
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        preemption=config.preemption,
        preemption_mode=config.preemption_mode,
        swap_space_slots=config.swap_space_bytes // layout.record_bytes,
    ).build(allocator)
    # The scheduler's SwapSpace hands out host block ids: the host pool has exactly its blocks.
    num_host_blocks = scheduler.swap_space.num_blocks if scheduler.swap_space else 0
    runner = ModelRunner(model, model_config, page_format, num_blocks, num_host_blocks, backend)
    cuda_graphs = graphs_wanted(config, placement)
    if cuda_graphs:
        graphs_line = runner.capture_graphs(config.max_num_seqs, max_model_len)
    threads_line = runner.share_cpu(config.adapt_threads)
    report = startup_report(policy, resolution, allocator, runner, layout, max_model_len)
    report += f"\npagedkv: {placement.describe()}" + (
        " (Triton's interpreter on the CPU: for tests, slow)"
        if rule.name == "triton" and placement.device.type == "cpu"
        else ""
    )
    for line in notes:
        report += f"\npagedkv: {line}"
    if cuda_graphs:
        report += f"\npagedkv: {graphs_line}"
    if threads_line:
        report += f"\npagedkv: {threads_line}"
    store = store_tiers(config, page_format, model, runner.kv_caches)
    for line in attach_tiers(allocator, runner, num_host_kv_blocks, store):
        report += f"\npagedkv: {line}"
    instance_id = new_instance_id()
    # After the tiers: the allocator hands the event log to a host tier too.
    kv_events, lines = open_kv_events(config, allocator, instance_id)
    for line in lines:
        report += f"\npagedkv: {line}"
    # How the projections compute (the quantized kernels chosen at load), when the loader said.
    for line in getattr(model, "weights_report", "").splitlines():
        report += f"\npagedkv: {line}"
    report += "\npagedkv: page format " + ", ".join(
        f"{k}={v}" for k, v in page_format.to_dict().items()
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
        kv_events,
        instance_id,
        store[0][0] if store else None,
        placement,
    )


def engine_placement(config: EngineConfig) -> Placement:
    """The engine's device, dtype and attention backend. ``UsageError``: no such device, or
    CUDA graphs asked for without a GPU and the Triton backend."""
    placement = resolve_placement(config.device, config.dtype, config.attention_backend)
    if config.cuda_graphs and not graphs_possible(placement):
        raise UsageError(
            "--cuda-graphs needs --device cuda and the triton attention backend",
            param="cuda_graphs",
        )
    return placement


def graphs_possible(placement: Placement) -> bool:
    """CUDA graphs replay the Triton backend's decode steps on a GPU, nothing else."""
    return placement.device.type == "cuda" and placement.attention_backend == "triton"


def graphs_wanted(config: EngineConfig, placement: Placement) -> bool:
    """``config.cuda_graphs``, or by default on wherever they can run."""
    return graphs_possible(placement) if config.cuda_graphs is None else config.cuda_graphs


def startup_report(
    policy: Policy,
    resolution: BlockSizeResolution,
    allocator: KVAllocator,
    runner: ModelRunner,
    layout: KVLayout,
    max_model_len: int,
) -> str:
    """The start-up lines. The pool is counted in *usable* blocks, the allocator's own count,
    which every snapshot, metric and refusal message uses too; blocks the runner holds beyond
    them (the null block that pads block tables) are named apart."""
    usable, size = allocator.num_total_blocks, allocator.block_size
    num_null = runner.num_blocks - usable
    null = f" (+{num_null} null block)" if num_null == 1 else f" (+{num_null} null blocks)"
    preset_size = policy.block_size
    overridden = policy.allocator != "reserved" and preset_size not in (None, size)
    override = f"; its block size {preset_size} replaced by {size}" if overridden else ""
    unit = policy.prefix_match_unit
    if unit is not None and unit < size:
        override += f"; prefix matches in units of {unit} tokens (partial blocks reused)"
    return "\n".join(
        [
            f"pagedkv: policy {policy.name} ({policy.description}{override})",
            f"pagedkv: {resolution.log_line()}",
            f"pagedkv: KV pool {usable} usable blocks x {size} tokens = {usable * size} slots"
            f"{null if num_null else ''}, {runner.kv_cache_bytes / 2**20:.1f} MiB "
            f"({layout.record_bytes} bytes per token); max_model_len {max_model_len}",
        ]
        + swap_report_lines(runner)
    )


def check_swap_space(config: EngineConfig, layout: KVLayout, block_size: int) -> None:
    """``UsageError`` when swap preemption's host space cannot hold one block."""
    block_bytes = layout.block_bytes(block_size)
    if config.preemption_mode == "swap" and config.swap_space_bytes < block_bytes:
        raise UsageError(
            f"--swap-space of {config.swap_space_bytes} bytes holds no KV block of {block_size} "
            f"tokens ({block_bytes} bytes each): give {block_bytes} bytes or more",
            param="swap_space",
        )


def swap_report_lines(runner: ModelRunner) -> list[str]:
    """The host swap pool's line, when swap preemption is on."""
    pool = runner.swap_pool
    if pool is None:
        return []
    return [
        f"pagedkv: host swap pool {pool.num_blocks} blocks x {pool.block_size} tokens = "
        f"{pool.num_blocks * pool.block_size} slots, {pool.pool_bytes / 2**20:.1f} MiB in host "
        "memory (preemption swaps KV out, recompute when it is full)"
    ]
