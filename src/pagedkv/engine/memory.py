"""How big the KV pool is: given (``--kv-cache-memory``), the CPU default, or sized from the card.

On a GPU the pool takes what is left of ``--gpu-memory-utilization`` F x the card's memory once
the weights are in and the engine's largest step has run once (the rule of vLLM, whose users
know it): KV bytes = F x total - weights - activation peak - memory outside torch's allocator
(the CUDA context, cuBLAS workspaces, Triton's modules). Memory that other processes held when
this one started is not ours to count, so F must fit in what was free then: two processes on
one card (a P/D pair) each give their own F, and the second starts only where the first left
room. ``card_memory.py`` measures the figures; the rule here is plain arithmetic on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.pages.layout import KVLayout
from pagedkv.units import format_bytes, size_at_least

# The CPU pool when --kv-cache-memory is not given: a GPU's default is sized from the card.
CPU_KV_CACHE_MEMORY_BYTES = 512 << 20
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def check_utilization(value: object) -> float:
    """``--gpu-memory-utilization`` as a float in (0, 1], else ``UsageError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise UsageError(
            f"--gpu-memory-utilization must be a fraction of the card's memory in (0, 1], "
            f"got {value!r}",
            "gpu_memory_utilization",
        )
    return float(value)


@dataclass(frozen=True)
class CardMemory:
    """What start-up measured on the card, in bytes (``card_memory.measure_card``).

    ``available_at_start_bytes``: free when the engine started, plus what torch in this process
    already held then (a model loaded before the engine is ours, not another process's).
    ``weights_bytes``: torch memory the engine holds once the weights are in.
    ``activation_peak_bytes``: the largest step's peak above that (its scratch KV excluded).
    ``non_torch_bytes``: this process's growth outside torch's allocator since the start."""

    total_bytes: int
    available_at_start_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int


@dataclass(frozen=True)
class PoolSize:
    """The pool's bytes and the start-up line that says where the number came from."""

    kv_bytes: int
    line: str


def kv_bytes_from_card(card: CardMemory, utilization: float) -> PoolSize:
    """F x total minus what the engine needs besides KV; ``UsageError`` (one line, naming
    ``--gpu-memory-utilization``) when F asks for more than was free at start-up, or leaves
    nothing for KV."""
    f = check_utilization(utilization)
    budget = int(card.total_bytes * f)
    gib = format_bytes
    if budget > card.available_at_start_bytes:
        most = int(card.available_at_start_bytes / card.total_bytes * 100) / 100
        fix = f"give --gpu-memory-utilization {most:.2f} or less" if most > 0 else "free the card"
        raise UsageError(
            f"--gpu-memory-utilization {f:g} asks for {gib(budget)} of the card's "
            f"{gib(card.total_bytes)}, but only {gib(card.available_at_start_bytes)} was free "
            f"when this engine started (other processes hold the rest): {fix}",
            "gpu_memory_utilization",
        )
    other = card.weights_bytes + card.activation_peak_bytes + card.non_torch_bytes
    kv_bytes = budget - other
    figures = (
        f"weights {gib(card.weights_bytes)}, activation peak {gib(card.activation_peak_bytes)}, "
        f"outside torch {gib(card.non_torch_bytes)}"
    )
    if kv_bytes <= 0:
        raise UsageError(
            f"--gpu-memory-utilization {f:g} gives {gib(budget)} of the card's "
            f"{gib(card.total_bytes)}, and the engine needs {gib(other)} besides KV ({figures}): "
            "nothing is left for the KV pool; raise --gpu-memory-utilization, or lower "
            "--max-num-batched-tokens",
            "gpu_memory_utilization",
        )
    line = (
        f"KV pool sized from the card: --gpu-memory-utilization {f:g} x {gib(card.total_bytes)} "
        f"= {gib(budget)}, less {figures} = {gib(kv_bytes)} for KV"
    )
    return PoolSize(kv_bytes, line)


def check_fits_one_sequence(
    size: PoolSize, num_usable_blocks: int, block_size: int, max_model_len: int
) -> str:
    """``UsageError`` when a card-sized pool cannot hold one sequence of ``max_model_len``
    tokens (a default that cannot serve a full-length request is no default); else the line's
    tail: blocks, tokens, and how many such sequences fit."""
    need = -(-max_model_len // block_size)
    if num_usable_blocks < need:
        raise UsageError(
            f"{size.line}: {num_usable_blocks} blocks of {block_size} tokens, under the {need} "
            f"one sequence of max_model_len {max_model_len} needs; raise "
            "--gpu-memory-utilization, or lower --max-model-len",
            "gpu_memory_utilization",
        )
    fit = num_usable_blocks // need
    return (
        f"{size.line} = {num_usable_blocks} blocks = {num_usable_blocks * block_size} tokens; "
        f"{fit} sequence{'' if fit == 1 else 's'} of max_model_len {max_model_len} fit"
    )


def fixed_pool_blocks(memory_bytes: int, layout: KVLayout, block_size: int, reserved: bool) -> int:
    """The blocks of a pool of ``memory_bytes`` (``--kv-cache-memory``, or the CPU default);
    ``UsageError`` (one line, in MiB/GiB, with the smallest --kv-cache-memory that works) under
    2 blocks; under ``reserved`` (a block is a max_model_len region) also the largest
    --max-model-len that fits the memory given."""
    block_bytes = layout.block_bytes(block_size)
    num_blocks = memory_bytes // block_bytes
    if num_blocks >= 2:
        return num_blocks
    sizes = f"{format_bytes(block_bytes)} each, {format_bytes(layout.record_bytes)} per token"
    fixes = f"give --kv-cache-memory {size_at_least(2 * block_bytes)} or more"
    if reserved:
        sizes = f"policy reserved: one max_model_len region per sequence, {sizes}"
        if (max_len := memory_bytes // (2 * layout.record_bytes)) >= 1:
            fixes += f", or --max-model-len {max_len} or less"
    raise UsageError(
        f"--kv-cache-memory {format_bytes(memory_bytes)} has room for {num_blocks} "
        f"block{'' if num_blocks == 1 else 's'} of {block_size} tokens ({sizes}); "
        f"the KV pool needs at least 2: {fixes}",
        param="kv_cache_memory",
    )


def check_pool_fits(pool_bytes: int, free_bytes: int | None, device_type: str) -> None:
    """``UsageError`` naming ``--kv-cache-memory`` when a given pool is larger than the memory
    free where it goes (the host's available memory, or the card's free memory; None: unknown,
    not checked), instead of the allocator's own error once the weights are loaded."""
    if free_bytes is None or pool_bytes <= free_bytes:
        return
    where = "this machine's available memory" if device_type == "cpu" else "the card's free memory"
    raise UsageError(
        f"--kv-cache-memory {format_bytes(pool_bytes)} is more than {where} "
        f"({format_bytes(free_bytes)}): give a smaller size",
        param="kv_cache_memory",
    )
