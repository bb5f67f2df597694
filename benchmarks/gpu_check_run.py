"""What every section of ``gpu_check.py`` reads: the paths and constants, the sizes the device
run and the dry run differ by, the ``Run`` (flags, sizes, device, state handed from one section
to a later one) and ``attempt``, which keeps one failing part from losing the rest."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

WHEELS = Path(__file__).resolve().parents[1] / "wheels"
SMALL_GGUF = "SmolLM2-135M-Instruct-6layers.gguf"  # what gpu_wheels.sh writes there
TRACE = "azure_llm_2023_conv.csv"
GIB = 1 << 30


@dataclass(frozen=True)
class Sizes:
    """Everything the device run and the dry run size differently (nothing else differs)."""

    kernel_block_sizes: tuple[int, ...]
    greedy_prompts: int
    greedy_tokens: int
    greedy_layers: int | None  # a copy of the embedded GGUF with this many layers (dry run)
    ledger_block_sizes: tuple[int, ...]
    ledger_contexts: tuple[int, ...]
    ledger_batches: tuple[int, ...]
    ledger_repeats: int
    ledger_warmup: int
    ledger_budget_s: float  # points not started by then are skipped
    ledger_pool_bytes: int  # points whose K+V pool is larger are skipped
    prefill_contexts: tuple[int, ...]  # whole prompts timed through paged prefill and SDPA
    copy_bytes: int
    flush_bytes: int  # a buffer over the L2 size, zeroed before each timed call (0: none)
    engine_model: str  # "llama-3-8b" or "tiny"
    engine_requests: int
    max_prompt: int
    max_output: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    hf_batch: int
    hf_max_s: float  # transformers starts no batch that would end past this much time
    batch1_prompt: int  # the batch-1 latency run: its prompt's tokens
    batch1_tokens: int  # and its decode steps
    gemm_peak_dim: int  # the square bf16 product the prompt GEMMs are held against
    profile_plan: dict = field(default_factory=dict)  # ProfilePlan's fields
    # section mla: the record's (rank, rope dims), query heads, contexts, batches, block sizes;
    # the contexts of its correctness cases
    mla_dims: tuple[int, int] = (512, 64)
    mla_heads: tuple[int, ...] = (16, 128)
    mla_contexts: tuple[int, ...] = (1024, 4096, 16384)
    mla_batches: tuple[int, ...] = (32, 64, 128)
    mla_block_sizes: tuple[int, ...] = (1, 16, 64)
    mla_check_lens: tuple[int, ...] = (1, 37, 200, 0)
    # each section's likely seconds: one that would end past --deadline-s is not started
    section_s: dict = field(default_factory=dict)


DEVICE_SIZES = Sizes(
    kernel_block_sizes=(1, 3, 16, 64, 2048), greedy_prompts=8, greedy_tokens=32, greedy_layers=None,
    ledger_block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    ledger_contexts=(1024, 4096, 16384, 32768), ledger_batches=(1, 8, 32, 128, 256),
    ledger_repeats=20, ledger_warmup=3, ledger_budget_s=120.0, ledger_pool_bytes=40 * GIB,
    prefill_contexts=(1024, 4096, 16384), copy_bytes=2 * GIB, flush_bytes=256 << 20,
    engine_model="llama-3-8b", engine_requests=256, max_prompt=2048, max_output=256,
    max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_bytes=40 * GIB, hf_batch=64,
    hf_max_s=30.0, batch1_prompt=2048, batch1_tokens=64, gemm_peak_dim=8192,
    profile_plan=dict(block_sizes=(16,), batch_sizes=(1, 8, 32, 128, 256),
                      context_lens=(256, 1024), prefill_lens=(64, 512, 2048), steps_per_point=3,
                      max_num_batched_tokens=8192),
    # From the H200 run of 2026-12-04 (gpu_check.err) and what each section added since.
    section_s=dict(kernels=45, greedy=40, service=80, ledger=60, mla=40, engine=150,
                   profile_sim=15, clock=80),
)  # fmt: skip
DRY_SIZES = Sizes(
    kernel_block_sizes=(1, 16), greedy_prompts=2, greedy_tokens=4, greedy_layers=2,
    ledger_block_sizes=(1, 3, 16), ledger_contexts=(40,), ledger_batches=(2,), ledger_repeats=2,
    ledger_warmup=1, ledger_budget_s=float("inf"), ledger_pool_bytes=GIB, prefill_contexts=(40,),
    copy_bytes=8 << 20, flush_bytes=0,
    engine_model="tiny", engine_requests=3, max_prompt=24, max_output=4, max_num_seqs=2,
    max_num_batched_tokens=64, kv_cache_bytes=8 << 20, hf_batch=2, hf_max_s=float("inf"),
    batch1_prompt=16, batch1_tokens=4, gemm_peak_dim=128,
    profile_plan=dict(block_sizes=(16,), batch_sizes=(1, 2), context_lens=(16,),
                      prefill_lens=(8, 32), steps_per_point=2, max_num_batched_tokens=64),
    mla_dims=(64, 16), mla_heads=(4,), mla_contexts=(40,), mla_batches=(2,),
    mla_block_sizes=(1, 16), mla_check_lens=(1, 21, 0),
)  # fmt: skip


@dataclass
class Run:
    """What every section reads: the flags, sizes and device, and ``state`` that a later
    section takes from an earlier one (section 5 reuses section 4's model and eager run)."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    scratch: Path
    started: float
    state: dict = field(default_factory=dict)

    def seconds_left(self) -> float:
        """Until ``--deadline-s``, the time by which the check must have ended."""
        return self.args.deadline_s - (time.perf_counter() - self.started)

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.started:7.1f} s] {message}", file=sys.stderr,
              flush=True)  # fmt: skip

    def free_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def attempt(errors: dict, key: str, fn, *args):
    """``fn(*args)``; when it raises, None and the error in ``errors[key]``: one failing part
    of a section (a kernel that does not compile, an engine out of memory) must not lose the
    rest of it."""
    try:
        return fn(*args)
    except Exception as exc:
        errors[key] = f"{type(exc).__name__}: {exc}"
        return None
