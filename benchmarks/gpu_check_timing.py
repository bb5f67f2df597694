"""The ledger's measurement: per-call times (CUDA events on a GPU, the wall clock on the CPU),
the device-to-device copy bandwidth a memory-bound kernel is held against, and paged decode's
time and bandwidth at one (context, batch, block size) point."""

from __future__ import annotations

import statistics
import time

import torch

# -- timing ---------------------------------------------------------------------------------------


def time_ms(fn, device: torch.device, repeats: int, warmup: int, flush: torch.Tensor | None):
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones. On a
    GPU: CUDA events around each call, the L2 cleared first (``flush`` zeroed: a decode step
    reads its KV from memory, not cache) and the GPU kept busy (``torch.cuda._sleep``) while the
    host queues the call, so the launch's host cost is not timed. On the CPU: the wall clock."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU work: the timed launch queues behind it
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Bytes read plus written per second of a device-to-device copy of ``num_bytes`` (the
    median of ``repeats``): the ceiling a memory-bound kernel is held against."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = statistics.median(time_ms(lambda: dst.copy_(src), device, repeats, 2, None))
    return 2 * num_bytes / (ms / 1e3) / 1e9


def decode_times(
    kernels,
    k_flat,
    v_flat,
    context_len: int,
    batch: int,
    block_size: int,
    num_q_heads: int,
    repeats: int,
    warmup: int,
    flush,
) -> list[dict]:
    """Paged decode over ``batch`` sequences of ``context_len`` tokens in shuffled blocks of a
    pool viewed from ``k_flat``/``v_flat`` [tokens, Hkv, D]: the median time and the bandwidth
    with the split count ``decode_splits`` chooses, and with one pass when that is not 1."""
    from pagedkv.model.triton.kernels import num_sms

    device, (_, num_kv_heads, head_dim) = k_flat.device, k_flat.shape
    num_blocks = batch * -(-context_len // block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = k_flat[: num_blocks * block_size].view(shape)
    v_cache = v_flat[: num_blocks * block_size].view(shape)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_q_heads, head_dim, dtype=k_flat.dtype, device=device)
    out = torch.empty_like(q)
    # K and V of every context token, q in and out back, the block tables.
    moved = batch * context_len * 2 * k_flat[0].nbytes + 2 * q.nbytes + tables.nbytes
    rule = kernels.decode_splits(batch, num_kv_heads, context_len, block_size, num_sms(device))
    timed = []
    for variant, splits in (("rule", rule), ("one pass", 1))[: 1 if rule == 1 else 2]:

        def call(splits=splits):
            kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5,
                                 num_splits=splits, out=out)  # fmt: skip

        ms = statistics.median(time_ms(call, device, repeats, warmup, flush))
        timed.append({"variant": variant, "num_splits": splits, "median_ms": ms,
                      "bytes": moved, "gb_s": moved / (ms / 1e3) / 1e9})  # fmt: skip
    return timed
