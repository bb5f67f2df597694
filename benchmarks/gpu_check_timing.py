"""The ledger's measurement: per-call times (CUDA events on a GPU, the wall clock on the CPU),
the device-to-device copy bandwidth a memory-bound kernel is held against, paged decode's
time and bandwidth at one (context, batch, block size) point, paged or contiguous, and prefill
attention's TFLOP/s beside torch's fused attention on the same shapes."""

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
    contiguous: bool = False,
) -> list[dict]:
    """Paged decode over ``batch`` sequences of ``context_len`` tokens in shuffled blocks of a
    pool viewed from ``k_flat``/``v_flat`` [tokens, Hkv, D]: the median time and the bandwidth
    with the split count ``decode_splits`` chooses, and with one pass when that is not 1.
    ``contiguous``: the same kernel on one block of ``context_len`` per sequence in order (the
    identity table: what paging's cost is measured against); ``block_size`` is ignored."""
    from pagedkv.model.triton.kernels import num_sms

    device, (_, num_kv_heads, head_dim) = k_flat.device, k_flat.shape
    if contiguous:
        block_size = context_len
    num_blocks = batch * -(-context_len // block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = k_flat[: num_blocks * block_size].view(shape)
    v_cache = v_flat[: num_blocks * block_size].view(shape)
    order = (
        torch.arange(num_blocks, device=device)
        if contiguous
        else torch.randperm(num_blocks, device=device)
    )
    tables = order.to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_q_heads, head_dim, dtype=k_flat.dtype, device=device)
    out = torch.empty_like(q)
    # K and V of every context token, q in and out back, the block tables.
    moved = batch * context_len * 2 * k_flat[0].nbytes + 2 * q.nbytes + tables.nbytes
    rule = kernels.decode_splits(batch, num_kv_heads, context_len, num_sms(device))
    timed = []
    for variant, splits in (("rule", rule), ("one pass", 1))[: 1 if rule == 1 else 2]:

        def call(splits=splits):
            kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5,
                                 num_splits=splits, out=out)  # fmt: skip

        ms = statistics.median(time_ms(call, device, repeats, warmup, flush))
        timed.append({"variant": variant, "num_splits": splits, "median_ms": ms,
                      "bytes": moved, "gb_s": moved / (ms / 1e3) / 1e9,
                      "layout": "contiguous" if contiguous else "paged"})  # fmt: skip
    return timed


def prefill_times(
    kernels, context_len: int, block_size: int, heads: tuple[int, int, int], dtype, device,
    repeats: int, warmup: int,
) -> dict:  # fmt: skip
    """One whole prompt of ``context_len`` tokens (causal, no prefix) through pagedkv's paged
    prefill in blocks of ``block_size``, and through torch's fused attention
    (``scaled_dot_product_attention``, causal) on the same contiguous Q, K and V: median
    milliseconds and TFLOP/s of each, counting 2 x 2 x L^2 / 2 x Hq x D multiply-adds."""
    num_q_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(context_len, num_q_heads, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(context_len, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn_like(k)
    num_blocks = -(-context_len // block_size)
    pool = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(pool, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, num_kv_heads, head_dim)[:context_len] = k
    v_cache.view(-1, num_kv_heads, head_dim)[:context_len] = v
    tables = torch.arange(num_blocks, dtype=torch.int32, device=device).view(1, -1)
    lens = torch.tensor([context_len], dtype=torch.int32, device=device)
    starts = torch.tensor([0, context_len], dtype=torch.int32, device=device)
    tiles = torch.tensor(kernels.prefill_tiles([0, context_len], 16), dtype=torch.int32,
                         device=device)  # fmt: skip
    scale = head_dim**-0.5

    def ours():
        kernels.paged_prefill(q, k_cache, v_cache, tables, lens, starts, tiles, scale)

    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    def fused():
        torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                         scale=scale, enable_gqa=True)  # fmt: skip

    flop = 2 * 2 * context_len * context_len / 2 * num_q_heads * head_dim
    row = {"context_len": context_len, "block_size": block_size, "flop": flop}
    for name, fn in (("pagedkv", ours), ("torch_sdpa", fused)):
        ms = statistics.median(time_ms(fn, device, repeats, warmup, None))
        row[name] = {"median_ms": ms, "tflop_s": flop / (ms / 1e3) / 1e12}
    row["pagedkv_over_sdpa"] = row["pagedkv"]["tflop_s"] / row["torch_sdpa"]["tflop_s"]
    return row
