"""The card's memory figures that size a GPU's KV pool (``memory.py`` holds the rule).

``card_start`` is read before the weights load; ``measure_card`` after, around one run of the
engine's largest step (``profile_peak_bytes``): a forward over ``max_num_batched_tokens``
prompt tokens, then sampling ``max_num_seqs`` rows with top-k and top-p (the sort over the
vocabulary is the sampler's peak). Both run on the CPU too (the profile step is tested there);
only the figures are CUDA's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.engine.memory import CardMemory
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.step.sampler import sample
from pagedkv.model.attention_backend import AttentionBackend
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.kv_pool import allocate_kv_caches
from pagedkv.model.llama import CausalLM
from pagedkv.pages.page_format import PageFormat


@dataclass(frozen=True)
class CardStart:
    """The card before this engine loaded anything (bytes)."""

    total_bytes: int
    free_bytes: int
    torch_reserved_bytes: int  # what torch in this process held already


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free where a pool on ``device`` goes: the card's free memory, or the host's
    available memory (Linux's MemAvailable; None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def card_start(device: torch.device) -> CardStart:
    """The card's figures now (creates the CUDA context first, so it counts as ours)."""
    free, total = torch.cuda.mem_get_info(device)
    return CardStart(total, free, torch.cuda.memory_reserved(device))


def measure_card(device: torch.device, start: CardStart, peak: Callable[[], int]) -> CardMemory:
    """The figures after the weights loaded; ``peak()`` runs the largest step and returns its
    torch peak above what was allocated when it began (``profile_peak_bytes``)."""
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device)
    activation_peak = peak()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the step's scratch goes back to the card before it is measured
    free, total = torch.cuda.mem_get_info(device)
    torch_growth = torch.cuda.memory_reserved(device) - start.torch_reserved_bytes
    non_torch = max(0, (start.free_bytes - free) - torch_growth)
    return CardMemory(
        total_bytes=total,
        available_at_start_bytes=start.free_bytes + start.torch_reserved_bytes,
        weights_bytes=weights,
        activation_peak_bytes=activation_peak,
        non_torch_bytes=non_torch,
    )


def profile_peak_bytes(
    model: CausalLM,
    backend: AttentionBackend | None,
    page: PageFormat,
    num_tokens: int,
    max_model_len: int,
    num_rows: int,
) -> int:
    """Run the engine's largest step once on dummy tokens: ``num_tokens`` prompt tokens in
    sequences of at most ``max_model_len``, on a scratch pool of ``page`` that holds them; then
    sample ``num_rows`` rows (top-k and top-p: the sort is the sampler's peak), attention on
    ``backend`` (None: the model's default). Returns the peak
    torch memory above what was allocated once the scratch pool existed (0 off CUDA)."""
    device = model.device
    lens = [max_model_len] * (num_tokens // max_model_len)
    lens += [num_tokens % max_model_len] if num_tokens % max_model_len else []
    block_size = page.block_size
    blocks = [-(-n // block_size) for n in lens]
    kv_caches = allocate_kv_caches(page, sum(blocks) + 1, device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if on_cuda else 0
    meta = _contiguous_metadata(lens, blocks, block_size)
    positions = torch.cat([torch.arange(n) for n in lens])
    input_ids = torch.zeros(num_tokens, dtype=torch.int64)
    plan = None if backend is None else backend.plan(meta, kv_caches, block_size)
    hidden = model(input_ids, positions, kv_caches, meta, block_size, plan)
    rows = hidden[: min(num_rows, num_tokens)]
    logits = model.compute_logits(rows.repeat(-(-num_rows // rows.shape[0]), 1)[:num_rows])
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * num_rows
    sample(logits, params, [None] * num_rows)
    if not on_cuda:
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _contiguous_metadata(lens: list[int], blocks: list[int], block_size: int) -> AttentionMetadata:
    """Sequence ``i`` of ``lens[i]`` new tokens in consecutive blocks after the null block 0:
    its token ``t`` lands in slot ``first_block * block_size + t``."""
    firsts = [1 + sum(blocks[:i]) for i in range(len(blocks))]
    width = max(blocks)
    table = [
        [f + j for j in range(n)] + [0] * (width - n) for f, n in zip(firsts, blocks, strict=True)
    ]
    slots = torch.cat([f * block_size + torch.arange(n) for f, n in zip(firsts, lens, strict=True)])
    starts = torch.tensor([0, *lens]).cumsum(0)
    return AttentionMetadata(
        slot_mapping=slots.to(torch.int64),
        block_tables=torch.tensor(table, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=starts.to(torch.int32),
    )
