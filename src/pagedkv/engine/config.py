"""``EngineConfig``: everything the engine is built from, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, check_utilization
from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy, get_policy
from pagedkv.kvstore.address import parse_store_url
from pagedkv.pages.backends import check_backend_name
from pagedkv.pages.kv_dtypes import ENGINE_DTYPES
from pagedkv.placement import WEIGHT_FORMATS, check_device_name
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.limits import check_limits, check_preemption, check_swap_space
from pagedkv.units import check_block_size


@dataclass(frozen=True)
class EngineConfig:
    """``model`` None = the embedded SmolLM2-135M-Instruct. ``block_size`` None = the policy's.
    ``max_model_len`` None = min(the model's context, 2048). The scheduler's limits and the
    preemption settings take ``SchedulerConfig``'s defaults and rules (``sched/limits.py``).
    ``device``/``dtype``/``attention_backend``: resolved at start-up (``model/device.py``):
    auto = a GPU when torch sees one; dtype None = float32 on the CPU, bfloat16 on a GPU;
    backend None = torch on the CPU, triton on a GPU."""

    model: str | None = None
    dtype: str | None = None
    device: str = "auto"
    attention_backend: str | None = None
    # Decode steps replayed from CUDA graphs captured per batch-size bucket (CUDA and the Triton
    # backend only); None = on where they can run (a GPU with the Triton backend), else off.
    cuda_graphs: bool | None = None
    # Schedule the next step while the device computes this one (``engine/step/loop.py``); None =
    # on where the model runs on a GPU (on the CPU the forward pass is the host's own work).
    async_scheduling: bool | None = None
    # CPU: before each step, run as many threads as the cores other processes left free
    # (pagedkv/cpu_share.py), at most torch's count at start-up; False = that count always.
    adapt_threads: bool = True
    weights: str = "float"  # "int8" / "int4": weight-only quantized (model/quant.py)
    policy: str = "vllm"
    block_size: int | None = None
    # Tokens a prefix match counts in (kvcache/partial.py); None = the policy's (whole blocks,
    # but 1 for trtllm). Below the block size a hit may end inside a block: its matched slots
    # are copied into a fresh block (or the block is claimed in place).
    prefix_match_unit: int | None = None
    # None: 512 MiB on the CPU, what gpu_memory_utilization leaves on a GPU (engine/memory.py).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_model_len: int | None = None
    preemption: str = SchedulerConfig.preemption
    # Host tier of evicted prefix blocks (engine/kv/setup.py); 0 = none.
    host_kv_memory_bytes: int = 0
    # What a preempted sequence's KV becomes: "recompute" (freed) or "swap" (copied to a host
    # pool of swap_space_bytes, copied back before it runs again; recompute when it is full).
    preemption_mode: str = SchedulerConfig.preemption_mode
    swap_space_bytes: int = 0
    log_startup: bool = True
    # The shared KV store tier (kvstore/): a redis://HOST:PORT[/DB] URL; None = no store.
    kv_store: str | None = None
    # KV events (engine/kv/events.py): a redis://HOST:PORT[/DB] URL the engine publishes its
    # prefix cache's changes to (a stream per instance, for routers); None = off.
    kv_events_url: str | None = None
    # Tensor parallelism (engine/ranks/): ranks, each a process with its share of the weights
    # and its KV heads (rank 0 is this engine; on GPUs one device a rank, from --device's).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        """Every check raises ``UsageError`` naming the field (these are the user's flags)."""
        check_device_name(self.device)
        check_backend_name(self.attention_backend)
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            raise UsageError(f"dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}", "dtype")
        if self.weights not in WEIGHT_FORMATS:
            raise UsageError(
                f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}", "weights"
            )
        if not isinstance(self.policy, str):
            raise UsageError(f"policy must be a name, got {self.policy!r}", "policy")
        try:
            get_policy(self.policy)
        except ValueError as exc:  # the registry lists the choices
            raise UsageError(str(exc), "policy") from None
        check_preemption(self.preemption, self.preemption_mode)
        if self.block_size is not None:
            check_block_size(self.block_size)
        self.engine_policy(self.block_size)  # --prefix-match-unit: checked before the model loads
        host = self.host_kv_memory_bytes
        if isinstance(host, bool) or not isinstance(host, int) or host < 0:
            raise UsageError(
                f"host_kv_memory_bytes must be an integer >= 0, got {host!r}", "host_kv_memory"
            )
        if self.kv_store is not None:
            parse_store_url(self.kv_store)  # one-line UsageError naming kv_store
        if self.kv_events_url is not None:
            try:
                parse_store_url(self.kv_events_url)
            except UsageError as exc:  # the same URL rule; the message names this flag
                raise UsageError(
                    str(exc).replace("--kv-store", "--kv-events"), "kv_events"
                ) from None
        check_utilization(self.gpu_memory_utilization)
        memory = self.kv_cache_memory_bytes
        if memory is not None and (
            isinstance(memory, bool) or not isinstance(memory, int) or memory < 1
        ):
            raise UsageError(
                f"kv_cache_memory_bytes must be an integer >= 1, got {memory!r}",
                "kv_cache_memory_bytes",
            )
        check_limits(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)
        self._check_tensor_parallel()
        # Host bytes here (whether one block fits is checked at start-up, once the block size
        # is known); the scheduler checks the token slots they become by the same rule.
        check_swap_space(
            self.preemption_mode, self.swap_space_bytes, "swap_space_bytes", "--swap-space"
        )

    def _check_tensor_parallel(self) -> None:
        """``--tensor-parallel-size``: a whole number >= 1 (whether the model's heads split is
        the start-up's check, once its shape is read); CUDA graphs replay one rank's step."""
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise UsageError(
                f"--tensor-parallel-size must be a whole number >= 1, got {tp!r}",
                "tensor_parallel_size",
            )
        if tp > 1 and self.cuda_graphs:
            raise UsageError(
                "--cuda-graphs with --tensor-parallel-size > 1 is not supported (the ranks' "
                "collectives are not captured): drop one",
                "cuda_graphs",
            )

    def engine_policy(self, block_size: int | None) -> Policy:
        """The policy with ``prefix_match_unit`` applied, checked at ``block_size`` (None: the
        requested or the preset's); ``UsageError`` naming ``--prefix-match-unit`` when the
        policy cannot match prefixes in that unit there."""
        policy = get_policy(self.policy)
        try:
            policy = policy.with_prefix_match_unit(self.prefix_match_unit)
        except ValueError as exc:
            raise UsageError(f"--prefix-match-unit: {exc}", "prefix_match_unit") from None
        problem = policy.unit_problem(block_size or self.block_size)
        if problem is not None:
            raise UsageError(f"--prefix-match-unit: {problem}", "prefix_match_unit")
        return policy
