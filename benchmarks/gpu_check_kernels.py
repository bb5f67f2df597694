"""The kernel section's cases: paged K/V pools in shuffled blocks, float64 torch references of
the Triton kernels, one error function per kernel (decode, prefill, KV write, block copy), the
tolerances they pass at, and the interpreter's bf16 dot widened for the dry run."""

from __future__ import annotations

import itertools
from functools import partial

import torch

NAN = float("nan")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


# -- paged pools and references ---------------------------------------------------------------


def paged_pool(context_lens, block_size, num_kv_heads, head_dim, dtype, device, gen):
    """K/V pools holding each sequence's context in shuffled blocks (3 spare blocks, so the ids
    are not 0..n-1); every slot no sequence owns is NaN, so a kernel reading past a context
    shows it. Returns k_cache, v_cache [N, B, Hkv, D], block_tables int32 [S, W] (0-padded),
    context_lens int32 [S], all on ``device``."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=torch.float32)
    v_cache = torch.full(shape, NAN, dtype=torch.float32)
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(max(blocks_per_seq), 1), dtype=torch.int32)
    taken = 0
    for s, n in enumerate(context_lens):
        tables[s, : blocks_per_seq[s]] = ids[taken : taken + blocks_per_seq[s]].to(torch.int32)
        taken += blocks_per_seq[s]
        slots = _slots(tables[s], n, block_size)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            n, num_kv_heads, head_dim, generator=gen
        )
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            n, num_kv_heads, head_dim, generator=gen
        )
    context = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(device) for t in (k_cache.to(dtype), v_cache.to(dtype), tables, context)]


def _slots(table_row: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    t = torch.arange(n)
    return table_row.cpu().long()[t // block_size] * block_size + t % block_size


def attention_reference(q, k_cache, v_cache, tables, context_lens, query_start_loc, scale):
    """float64 softmax(q K^T * scale) V on the CPU, K/V gathered slot by slot through each
    block table; new token i of a sequence of q_len new tokens sees keys up to
    context - q_len + i (bottom-right causal). Decode is the case q_len = 1. q [T, Hq, D]."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    k_flat = k_cache.cpu().double().reshape(-1, num_kv_heads, head_dim)
    v_flat = v_cache.cpu().double().reshape(-1, num_kv_heads, head_dim)
    q64 = q.cpu().double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(len(query_start_loc) - 1):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        ctx, q_len = int(context_lens[s]), end - start
        if ctx == 0 or q_len == 0:
            continue  # a padding row: the kernels write zeros
        slots = _slots(tables[s], ctx, block_size)
        k = k_flat[slots].repeat_interleave(group, dim=1)  # [ctx, Hq, D]: head h reads h // G
        v = v_flat[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q64[start:end], k) * scale
        visible = torch.arange(ctx)[None, :] <= (ctx - q_len + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out


KERNEL_HEADS = (8, 2, 128)  # query heads, KV heads (GQA 4), head dim of the kernel cases


def kernel_shapes(block_size: int, dry_run: bool):
    """(decode contexts, prefill (context, new tokens) per sequence) at one block size: the
    edges of a block, a padding row (context 0), long contexts; a whole prompt, a chunk on a
    cached prefix, a decode row, a long chunk."""
    b = block_size
    if dry_run:
        return [1, b + 1, 40, 0], [(20, 20), (2 * b + 5, 7), (b + 3, 1)]
    return ([1, b - 1, b, b + 1, 3 * b + 5, 0, 517, 2000],
            [(300, 300), (2 * b + 5, 7), (b + 3, 1), (1000, 64), (b, b)])  # fmt: skip


def kernel_cases(kernels, block_size: int, dtype, device, gen, dry_run: bool):
    """[(label, a call returning the kernel's max abs error against its reference)]: decode
    one-pass and split-K (2, 3 and ``decode_splits``' choice), prefill, KV write, block copy."""
    from pagedkv.model.triton.attention import PREFILL_BLOCK_M  # the engine's query tile
    from pagedkv.model.triton.kernels import num_sms

    num_q_heads, num_kv_heads, head_dim = KERNEL_HEADS
    scale = head_dim**-0.5
    decode_lens, prefill = kernel_shapes(block_size, dry_run)

    def decode(splits: int) -> float:
        pool = paged_pool(decode_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
        q = torch.randn(len(decode_lens), num_q_heads, head_dim, generator=gen).to(dtype)
        got = kernels.paged_decode(q.to(device), *pool, scale, num_splits=splits)
        starts = list(range(len(decode_lens) + 1))  # one new token each
        return max_abs_error(got, attention_reference(q, *pool, starts, scale))

    def prefill_error() -> float:
        pool = paged_pool([c for c, _ in prefill], block_size, num_kv_heads, head_dim, dtype,
                          device, gen)  # fmt: skip
        starts = list(itertools.accumulate([n for _, n in prefill], initial=0))
        q = torch.randn(starts[-1], num_q_heads, head_dim, generator=gen).to(dtype)
        tiles = torch.tensor(kernels.prefill_tiles(starts, PREFILL_BLOCK_M), dtype=torch.int32)
        got = kernels.paged_prefill(
            q.to(device), *pool, torch.tensor(starts, dtype=torch.int32, device=device),
            tiles.to(device), scale, block_m=PREFILL_BLOCK_M,
        )  # fmt: skip
        return max_abs_error(got, attention_reference(q, *pool, starts, scale))

    def mixed_error() -> float:
        """The mixed step as the engine runs it: prefill tiles over the chunks only, then the
        decode kernel over the one-token rows, found by their rows, into the same output."""
        pool = paged_pool([c for c, _ in prefill], block_size, num_kv_heads, head_dim, dtype,
                          device, gen)  # fmt: skip
        starts = list(itertools.accumulate([n for _, n in prefill], initial=0))
        q = torch.randn(starts[-1], num_q_heads, head_dim, generator=gen).to(dtype)
        tiles = torch.tensor(kernels.prefill_tiles(starts, PREFILL_BLOCK_M, 2),
                             dtype=torch.int32)  # fmt: skip
        got = kernels.paged_prefill(
            q.to(device), *pool, torch.tensor(starts, dtype=torch.int32, device=device),
            tiles.to(device), scale, block_m=PREFILL_BLOCK_M,
        )  # fmt: skip
        single = [i for i, (_, n) in enumerate(prefill) if n == 1]
        index = torch.tensor(single, device=device)
        rows = torch.tensor([starts[i] for i in single], dtype=torch.int32, device=device)
        kernels.paged_decode(q.to(device), pool[0], pool[1], pool[2][index], pool[3][index],
                             scale, out=got, rows=rows)  # fmt: skip
        return max_abs_error(got, attention_reference(q, *pool, starts, scale))

    rule = kernels.decode_splits(len(decode_lens), num_kv_heads, max(decode_lens),
                                 num_sms(device))  # fmt: skip
    cases = []
    for splits in sorted({1, 2, 3, rule}):
        label = "decode one-pass" if splits == 1 else f"decode split {splits}"
        cases.append((label + (" (rule)" if splits == rule else ""), partial(decode, splits)))
    return [*cases, ("prefill (prefix, ragged, decode row)", prefill_error),
            ("mixed step (chunks on prefill, decode rows on decode)", mixed_error),
            ("write_kv (slot -1 skipped)", partial(write_kv_error, kernels, block_size, dtype,
                                                   device, gen)),
            ("copy_blocks", partial(copy_blocks_error, kernels, block_size, dtype, device,
                                    gen))]  # fmt: skip


def write_kv_error(kernels, block_size: int, dtype, device, gen) -> float:
    """``write_kv`` of 2B+3 tokens into shuffled slots of a 6-block pool, every 4th slot -1,
    against ``index_copy_`` of the kept rows (exact: the values are already in ``dtype``)."""
    _, num_kv_heads, head_dim = KERNEL_HEADS
    shape = (6, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    num_tokens = 2 * block_size + 3
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padded rows: nothing written
    new = [torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
           for _ in range(2)]  # fmt: skip
    keep = slots >= 0
    wants = [c.clone().view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], x[keep])
             for c, x in zip(caches, new, strict=True)]  # fmt: skip
    on = [t.to(device) for t in (*new, *caches, slots)]
    kernels.write_kv(*on)
    written = zip(on[2:4], wants, strict=True)
    return max(max_abs_error(c.view(-1, num_kv_heads, head_dim), w) for c, w in written)


def copy_blocks_error(kernels, block_size: int, dtype, device, gen) -> float:
    """``copy_blocks`` of 3 shuffled pairs in an 8-block pool against indexing."""
    _, num_kv_heads, head_dim = KERNEL_HEADS
    cache = torch.randn((8, block_size, num_kv_heads, head_dim), generator=gen).to(dtype)
    src, dst = torch.tensor([0, 3, 5]), torch.tensor([6, 1, 7])
    want = cache.clone()
    want[dst] = cache[src]
    on = cache.to(device)
    kernels.copy_blocks(on, src.to(device), dst.to(device))
    return max_abs_error(on, want)


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| (NaN anywhere: inf, so it never passes a tolerance)."""
    diff = (got.cpu().double() - want.cpu().double()).abs()
    return float("inf") if torch.isnan(diff).any() else float(diff.max()) if diff.numel() else 0.0


FUSED_TOKENS = {"device": (1, 77, 4096), "dry": (1, 3)}


def fused_cases(device: torch.device, dry_run: bool, seed: int) -> list[dict]:
    """The fused kernels the Triton backend's layer runs (``bench_fused.cases``: RMSNorm,
    add + RMSNorm, SiLU * up, RoPE + KV write) against the torch ops they replace, in ulps, at
    Llama-3-8B's shapes (the dry run's tiny ones), within the tests' bounds. The dry run
    rounds the interpreter's bf16 casts as a GPU does while these run, and restores them."""
    from bench_fused import DRY_SHAPE, GPU_SHAPE, bound_ulps, cases, compare

    restore = None
    if dry_run:
        from triton.runtime import interpreter

        from bench_fused import interpreter_rounds_to_nearest_even

        restore = interpreter.InterpreterBuilder.cast_impl
        interpreter_rounds_to_nearest_even()
    rows = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for tokens in FUSED_TOKENS["dry" if dry_run else "device"]:
                shape = DRY_SHAPE if dry_run else GPU_SHAPE
                for name, (torch_fn, fused_fn, _) in cases(shape, tokens, dtype, device,
                                                           seed + tokens).items():  # fmt: skip
                    row = {"kernel": name, "dtype": str(dtype).removeprefix("torch."),
                           "tokens": tokens, "bound_ulps": bound_ulps(name, dtype, device)}  # fmt: skip
                    try:
                        row.update(compare(torch_fn(), fused_fn()))
                        row["ok"] = row["max_ulps"] <= row["bound_ulps"]
                    except Exception as exc:  # a kernel that does not compile: said, not lost
                        row.update(error=f"{type(exc).__name__}: {exc}", ok=False)
                    rows.append(row)
    finally:
        if restore is not None:
            interpreter.InterpreterBuilder.cast_impl = restore
    return rows
