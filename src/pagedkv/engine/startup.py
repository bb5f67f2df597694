"""Engine start-up: read the model's shape, resolve the block size, size the KV pool, build the
allocator and scheduler, then load the weights and build the runner. Everything decided here is printed once (``startup_report``):
the block size used with the reason for every rewrite, and the page-format fingerprint."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.card_memory import (
    CardStart,
    card_start,
    measure_card,
    profile_peak_bytes,
)
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv.events import EngineKVEvents, new_instance_id, open_kv_events
from pagedkv.engine.kv.identity import model_identity
from pagedkv.engine.kv.setup import attach_tiers
from pagedkv.engine.kv.store import store_tiers
from pagedkv.engine.memory import (
    check_fits_one_sequence,
    kv_bytes_from_card,
)
from pagedkv.engine.pool_plan import PoolPlan, graphs_wanted, plan_pool
from pagedkv.engine.ranks.startup import Ranks
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.startup_report import startup_report
from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvstore.tier import StoreTier
from pagedkv.model.attention_backend import make_backend
from pagedkv.model.config import ModelConfig
from pagedkv.model.device import Placement, make_current
from pagedkv.model.llama import CausalLM
from pagedkv.model.loader import load_model, read_model_shape
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.pages.layout import KVLayout
from pagedkv.pages.page_format import PageFormat
from pagedkv.planner.constraints import BlockSizeResolution
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.scheduler import Scheduler


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
    ranks: Ranks | None = None  # tensor parallelism's workers (``engine/ranks/``), if any

    @property
    def model_identity(self) -> str:
        """``kv/identity.model_identity`` of the loaded weights (computed on first use, then
        remembered per model): the store namespace, ``/pagedkv/info`` and the P/D pair."""
        return model_identity(self.model)


def build_parts(
    config: EngineConfig, loaded: tuple[ModelConfig, CausalLM, Tokenizer] | None = None
) -> EngineParts:
    """Build an engine's parts; ``loaded`` skips loading (an already built model), its model
    may be None (tests of the sizing alone: no runner's backend then).

    Four sections, each returning the lines it prints: the pool's plan (everything that
    depends only on the model's shape, its ``config.json`` or GGUF header, decided and checked
    *before* the 10-25 s weight load: a ``max_model_len`` beyond the model's context or a
    ``kv_cache_memory`` too small for the pool is a ``UsageError`` at once), the weights and
    the pool's size (from the card where it is not given), the runtime (allocator, scheduler,
    runner), and the extras (tiers, the store, KV events).
    """
    model_config = loaded[0] if loaded else ModelConfig.from_shape(read_model_shape(config.model))
    plan = plan_pool(config, model_config)
    make_current(plan.placement.device)
    start = card_start(plan.placement.device) if plan.num_blocks is None else None
    if loaded is not None and plan.split.tp_size > 1:
        raise UsageError(
            "a model loaded already is one rank's: give --tensor-parallel-size 1, or let the "
            "engine load the model",
            "tensor_parallel_size",
        )
    ranks = Ranks(config, plan)  # the workers load their shares while rank 0 loads its own
    try:
        return _build(config, model_config, plan, loaded, start, ranks)
    except BaseException:
        ranks.close()
        raise


def _build(
    config: EngineConfig,
    model_config: ModelConfig,
    plan: PoolPlan,
    loaded: tuple[ModelConfig, CausalLM, Tokenizer] | None,
    start: CardStart | None,
    ranks: Ranks,
) -> EngineParts:
    """``build_parts`` once the plan is checked and the ranks started."""
    if loaded is None:
        p = plan.placement
        rank = ranks.rank(model_config)
        loaded = load_model(
            config.model, p.dtype, weights=config.weights, device=p.device, rank=rank
        )
    _, model, tokenizer = loaded
    if model is not None and model.device != plan.placement.device:
        raise UsageError(f"the model is on {model.device}, the engine on {plan.placement.device}")
    backend = None if model is None else make_backend(plan.placement.backend, model, model.device)
    ranks.wait_loaded()
    num_blocks, card_lines = size_pool(config, plan, model, backend, start, ranks)
    runtime = build_runtime(config, plan, model_config, model, backend, num_blocks, ranks)
    extras = attach_extras(config, plan, runtime, model, ranks)
    lines = [
        *startup_report(
            plan.policy,
            plan.resolution,
            runtime.allocator,
            runtime.runner,
            plan.layout,
            plan.max_model_len,
        ),
        *plan.lines,
        *ranks.lines(),
        *card_lines,
        *runtime.lines,
        *extras.lines,
        "page format " + ", ".join(f"{k}={v}" for k, v in plan.page_format.to_dict().items()),
    ]
    return EngineParts(
        model_config=model_config,
        model=model,
        tokenizer=tokenizer,
        policy=plan.policy,
        layout=plan.layout,
        resolution=plan.resolution,
        page_format=plan.page_format,
        max_model_len=plan.max_model_len,
        allocator=runtime.allocator,
        scheduler=runtime.scheduler,
        runner=runtime.runner,
        startup_report="\n".join(f"pagedkv: {line}" for line in lines),
        kv_events=extras.kv_events,
        instance_id=extras.instance_id,
        kv_store=extras.kv_store,
        placement=plan.placement,
        ranks=ranks,
    )


def size_pool(
    config: EngineConfig,
    plan: PoolPlan,
    model,
    backend,
    start: CardStart | None,
    ranks: Ranks | None = None,
) -> tuple[int, list[str]]:
    """Section 2, the pool's size: the plan's blocks, or on a GPU without a given size what
    ``--gpu-memory-utilization`` of the card leaves once the weights and the largest step are
    in (``engine/memory.py``; under tensor parallelism the least of every rank's card, each
    measured at once: the largest step meets in its collectives), with the line that says
    whether one sequence fits."""
    if plan.num_blocks is not None or start is None:
        assert plan.num_blocks is not None
        return plan.num_blocks, []

    def peak() -> int:
        return profile_peak_bytes(
            model,
            backend,
            plan.page_format,
            config.max_num_batched_tokens,
            plan.max_model_len,
            config.max_num_seqs,
        )

    device, block_size = plan.placement.device, plan.page_format.block_size
    if ranks is not None:
        ranks.start_sizing()
    size = kv_bytes_from_card(measure_card(device, start, peak), config.gpu_memory_utilization)
    if ranks is not None:
        size = ranks.least(size)
    num_blocks = size.kv_bytes // plan.layout.block_bytes(block_size)
    # The allocator keeps one block back (the null block that pads block tables).
    return num_blocks, [
        check_fits_one_sequence(size, num_blocks - 1, block_size, plan.max_model_len)
    ]


@dataclass(frozen=True)
class Runtime:
    allocator: KVAllocator
    scheduler: Scheduler
    runner: ModelRunner
    lines: list[str]


def build_runtime(
    config: EngineConfig,
    plan: PoolPlan,
    model_config: ModelConfig,
    model,
    backend,
    num_blocks: int,
    ranks: Ranks | None = None,
) -> Runtime:
    """Section 3, the runtime: the allocator over ``num_blocks``, the scheduler, the runner
    with its pools (and host swap pool), CUDA graphs where wanted, the CPU threads (under
    tensor parallelism each rank's share, fixed: ``Ranks``)."""
    allocator = plan.policy.build(num_blocks, plan.max_model_len, plan.page_format.block_size)
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=plan.max_model_len,
        preemption=config.preemption,
        preemption_mode=config.preemption_mode,
        swap_space_slots=config.swap_space_bytes // plan.layout.record_bytes,
    ).build(allocator)
    # The scheduler's SwapSpace hands out host block ids: the host pool has exactly its blocks.
    num_host_blocks = scheduler.swap_space.num_blocks if scheduler.swap_space else 0
    make_runner = ModelRunner if ranks is None else ranks.runner_type()
    runner = make_runner(
        model,
        model_config,
        plan.page_format,
        num_blocks,
        num_host_blocks,
        backend,
    )
    lines = []
    if graphs_wanted(config, plan.placement):
        lines.append(runner.capture_graphs(config.max_num_seqs, plan.max_model_len))
    one_rank = ranks is None or ranks.size == 1
    if one_rank and (threads_line := runner.share_cpu(config.adapt_threads)):
        lines.append(threads_line)
    return Runtime(allocator, scheduler, runner, lines)


@dataclass(frozen=True)
class Extras:
    kv_store: StoreTier | None
    kv_events: EngineKVEvents | None
    instance_id: str
    lines: list[str]


def attach_extras(
    config: EngineConfig, plan: PoolPlan, runtime: Runtime, model, ranks: Ranks | None = None
) -> Extras:
    """Section 4, the extras: the host tier and the Redis store under the allocator (and the
    other ranks' pools built to match), the KV event stream (after the tiers: the allocator
    hands its log to a host tier too), and how the projections compute (the loader's report)."""
    runner, allocator = runtime.runner, runtime.allocator
    store = store_tiers(config, plan.page_format, model, runner.kv_caches)
    if ranks is not None and store and (ranked := ranks.store_executor(runner, store[0][0])):
        store = [(store[0][0], ranked)]
    lines = list(attach_tiers(allocator, runner, plan.num_host_kv_blocks, store))
    if ranks is not None:
        ranks.build(runner, plan.num_host_kv_blocks, store[0][0] if store else None)
    instance_id = new_instance_id()
    kv_events, event_lines = open_kv_events(config, allocator, instance_id)
    lines += event_lines
    lines += (model.weights_report if model is not None else "").splitlines()
    return Extras(store[0][0] if store else None, kv_events, instance_id, lines)
