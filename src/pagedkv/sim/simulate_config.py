"""``SimulateConfig``: everything a `pagedkv simulate` run depends on, validated on construction
(frozen; every bad value is a ``UsageError`` naming the field). ``sim.scenario_load`` loads and runs
it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.sim.costs.kernel import get_kernel

COST_MODELS = ("fitted", "kernel", "roofline")


@dataclass(frozen=True)
class SimulateConfig:
    """Everything a simulate run depends on. ``kv_memory_bytes`` empty: size the pool from
    the GPU (memory x utilization - weights - activations). ``strict``: a bad trace record is
    an error; otherwise it is skipped and listed in ``Scenario.skipped``."""

    trace: str | None = None
    synthetic: str | None = None
    model: str = "llama-3-8b"
    kv_dtype: str | None = None
    gpu: str = "A100-80GB"
    kv_memory_bytes: tuple[int, ...] = ()
    gpu_memory_utilization: float = 0.9
    activation_bytes: int = 4 * 2**30
    max_model_len: int = 32768
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    preemption: str = "latest_arrival"
    policies: tuple[str, ...] = ("reserved", "vllm")
    block_sizes: tuple[int, ...] = ()
    # Each policy with a prefix cache once per prefix match unit (None: whole blocks); () = the
    # policies' own (kvcache/partial.py).
    prefix_match_units: tuple[int | None, ...] = ()
    max_requests: int | None = None
    strict: bool = False
    rate_scale: float = 1.0
    seed: int = 0
    step_overhead_s: float = 0.002  # the kernel and roofline clocks' (fitted: its own)
    sample_interval_s: float = 1.0
    # "fitted" (the GPU's clock fitted to measured op times), "kernel" (roofline + an assumed
    # block walk) or "roofline"
    cost: str = "fitted"
    # a `pagedkv calibrate` JSON of either kind, "vllm-class" or "pagedkv-triton" (the shipped
    # clock of that kind for the GPU); None: the shipped vLLM-class one
    clock: str | None = None
    # a pagedkv-triton clock: decode steps replay CUDA graphs (None: its default, on)
    cuda_graphs: bool | None = None
    tensor_parallel: int = 1  # GPUs per replica (fitted clock only)
    kernel: str | None = None  # one attention kernel for every paged policy; None: per policy
    cost_profile: str | None = None  # a `pagedkv profile` JSON: replaces the GPU cost model
    preemption_mode: str = "recompute"  # or "swap"
    swap_space_bytes: int = 0  # host swap space (swap mode)
    host_link: str | None = None  # None: the GPU's own host link
    # Replicas behind a router (``sim/cluster.py``): 1 and no routers = one engine, as before.
    # Routers given with one replica run the cluster path (the same numbers as one engine).
    num_replicas: int = 1
    routers: tuple[str, ...] = ()  # routing policies, one run each; () with N > 1: round-robin
    balance_abs: int = 4  # prefix-aware's balance band (``pagedkv.routing.PrefixAware``)
    balance_rel: float = 0.25

    @property
    def is_cluster(self) -> bool:
        """Whether the run goes through ``Cluster`` (replicas > 1, or a router named)."""
        return self.num_replicas > 1 or bool(self.routers)

    @property
    def routing_policies(self) -> tuple[str, ...]:
        """The routers to run: as given, else round-robin."""
        return self.routers or ("round-robin",)

    def __post_init__(self) -> None:
        if (self.trace is None) == (self.synthetic is None):
            raise UsageError("give exactly one of --trace FILE or --synthetic SPEC")
        if not self.policies:
            raise UsageError("--policy: name at least one policy", "policy")
        finite = {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "rate_scale": self.rate_scale,
            "step_overhead_s": self.step_overhead_s,
            "sample_interval_s": self.sample_interval_s,
        }
        for name, value in finite.items():  # NaN passes every `<` check: test it first
            if not math.isfinite(value):
                raise UsageError(f"{name} must be a finite number, got {value}", name)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UsageError("gpu_memory_utilization must be in (0, 1]", "gpu_memory_utilization")
        positive = {"rate_scale": self.rate_scale, "sample_interval_s": self.sample_interval_s}
        for name, value in positive.items():
            if value <= 0:
                raise UsageError(f"{name} must be > 0, got {value}", name)
        if self.step_overhead_s < 0:
            raise UsageError("step_overhead_s must be >= 0", "step_overhead_s")
        if any(b < 1 for b in (*self.kv_memory_bytes, *self.block_sizes)):
            raise UsageError("KV pool sizes and block sizes must be >= 1")
        if any(u is not None and u < 1 for u in self.prefix_match_units):
            raise UsageError("--prefix-match-unit: units must be >= 1", "prefix_match_unit")
        if self.max_requests is not None and self.max_requests < 1:
            raise UsageError("max_requests must be >= 1", "max_requests")
        if self.cost not in COST_MODELS:
            raise UsageError(f"cost must be one of {', '.join(COST_MODELS)}, got {self.cost!r}")
        if self.kernel is not None:
            if self.cost == "roofline":
                raise UsageError("--kernel prices an attention kernel: drop --cost roofline")
            get_kernel(self.kernel)
        if self.clock is not None and self.cost != "fitted":
            raise UsageError("--clock is the fitted clock's file: drop --cost " + self.cost)
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise UsageError(
                f"--tensor-parallel-size must be a whole number >= 1, got {tp!r}",
                "tensor_parallel_size",
            )
        if tp > 1 and (self.cost != "fitted" or self.cost_profile is not None):
            raise UsageError(
                "--tensor-parallel-size > 1 is priced by the fitted clocks only (--cost fitted)",
                "tensor_parallel_size",
            )
        if self.cost_profile is not None and self.kernel is not None:
            raise UsageError("give --cost-profile or --kernel, not both")
        if self.swap_space_bytes < 0:
            raise UsageError("swap_space_bytes must be >= 0", "swap_space_bytes")
        if self.preemption_mode == "swap" and self.swap_space_bytes == 0:
            raise UsageError("--preemption-mode swap needs a --swap-space SIZE > 0")
        self._check_routing()

    def _check_routing(self) -> None:
        from pagedkv.routing import build_policy

        n = self.num_replicas
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"--replicas must be a whole number >= 1, got {n!r}", "replicas")
        if len(set(self.routers)) != len(self.routers):
            raise UsageError(f"--router: a policy is named twice in {self.routers}", "router")
        if not math.isfinite(self.balance_rel):
            raise UsageError(f"--balance-rel must be a finite number, got {self.balance_rel}")
        for name in self.routing_policies:  # unknown names and bad bands: UsageError
            build_policy(name, balance_abs=self.balance_abs, balance_rel=self.balance_rel)
