"""The paths of ``paged_attention`` (decode sequences padded together, gathered by blocks or by
slots; each prefill on its own, by the causal kernel when its whole context is new or with a
mask over a cached prefix; consecutive slots read as a view) against a naive reference:
softmax(q k^T * scale + causal mask) v, written out here with a loop over heads."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.model import native
from pagedkv.model.attention import AttentionPlan, paged_attention
from pagedkv.model.attention_metadata import AttentionMetadata

HQ, HKV, D = 6, 2, 8


def _naive(q_new, k_all, v_all, ctx, scale):
    """Attention of the last ``len(q_new)`` positions of a ``ctx``-token sequence."""
    n, hq, d = q_new.shape
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for h in range(hq):
        kv_head = h // (hq // k_all.shape[1])
        for i in range(n):
            pos = ctx - n + i
            scores = (k_all[: pos + 1, kv_head].double() @ q_new[i, h].double()) * scale
            out[i, h] = scores.softmax(0) @ v_all[: pos + 1, kv_head].double()
    return out.reshape(n, hq * d)


# B = 4: decode contexts gathered by whole blocks; B = 64: a block far longer than the
# contexts (like a reserved region), gathered slot by slot.
@pytest.mark.parametrize("kernels", ["torch", "native", "native-bf16"])
@pytest.mark.parametrize("B", [4, 64])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize(
    "ctx_and_new",
    [
        [(9, 9)],
        [(13, 1)],
        [(13, 1), (6, 1), (9, 1)],
        [(10, 10), (7, 1)],
        [(12, 5)],
        [(7, 1), (10, 10), (12, 5), (3, 1), (5, 5), (6, 6)],
        [(8, 1), (8, 1)],
    ],
    ids=[
        "whole-prefill",
        "decode-1",
        "decode-3",
        "prefill+decode",
        "chunk-on-prefix",
        "mixed-prefills-and-decodes",
        "decode-equal-contexts",
    ],
)
def test_fast_paths_match_the_naive_reference(ctx_and_new, consecutive, B, kernels):
    lib = None
    # bf16: queries and caches in bf16, the reference on the same (rounded) values in fp64.
    dtype = torch.bfloat16 if kernels.endswith("bf16") else torch.float32
    if kernels.startswith("native"):  # decode attention read through the block tables, in C
        lib = native.kernels()
        if lib is None:
            pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(len(ctx_and_new))
    num_blocks = 32 if B == 4 else 8
    k_cache = torch.zeros(num_blocks, B, HKV, D, dtype=dtype)
    v_cache = torch.zeros(num_blocks, B, HKV, D, dtype=dtype)
    order = (
        list(range(1, num_blocks))
        if consecutive
        else torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
    )
    tables, slots, qs, ks, vs, expected = [], [], [], [], [], []
    scale = 1 / math.sqrt(D)
    for ctx, new in ctx_and_new:
        blocks = [order.pop(0) for _ in range(math.ceil(ctx / B))]
        tables.append(blocks)
        k_all, v_all = (
            torch.randn(ctx, HKV, D, generator=gen).to(dtype),
            torch.randn(ctx, HKV, D, generator=gen).to(dtype),
        )
        seq_slots = [blocks[p // B] * B + p % B for p in range(ctx)]
        # The cached prefix is already in the pool; the new tokens arrive with the step.
        k_cache.view(-1, HKV, D)[seq_slots[: ctx - new]] = k_all[: ctx - new]
        v_cache.view(-1, HKV, D)[seq_slots[: ctx - new]] = v_all[: ctx - new]
        q_new = torch.randn(new, HQ, D, generator=gen).to(dtype)
        slots += seq_slots[ctx - new :]
        qs.append(q_new)
        ks.append(k_all[ctx - new :])
        vs.append(v_all[ctx - new :])
        expected.append(_naive(q_new, k_all, v_all, ctx, scale))
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in ctx_and_new], dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor([n for _, n in ctx_and_new]).cumsum(0).tolist()], dtype=torch.int32),
    )  # fmt: skip
    plan = AttentionPlan(meta, B, dtype, kernels=lib)
    out = paged_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), (k_cache, v_cache), plan, scale
    )
    assert out.dtype == dtype
    # bf16: the output's own rounding (2^-9 relative, |out| < 4) and bf16 SDPA for prefills.
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), torch.cat(expected), atol=atol)
    decodes = sum(new == 1 for _, new in ctx_and_new)
    if lib is not None:  # every sequence in one call of the paged kernel, no torch path
        assert plan.native is not None and plan.decode is None and not plan.prefills
        assert plan.native.decode_only == (decodes == len(ctx_and_new))
        return
    # The fast paths really ran: consecutive slots read as a view, a whole prompt by the
    # causal kernel over its own K/V (nothing gathered).
    if ctx_and_new in ([(13, 1)], [(12, 5)]) and consecutive:
        group = plan.decode if plan.decode is not None else plan.prefills[0]
        assert group.contiguous_from is not None
    if decodes > 1:
        gathered = plan.decode.gather_blocks if B == 4 else plan.decode.gather_slots
        assert gathered is not None
    if ctx_and_new == [(9, 9)]:
        assert plan.prefills[0].gather_slots is None


def _kernel_or_skip():
    lib = native.kernels()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    return lib


def _paged(lib, q, k_cache, v_cache, tables, ctx_lens, q_lens, threads=2):
    """One call of ``pk_paged_attention`` (or its bf16 form) over sequences whose new tokens
    are ``q_lens`` consecutive rows of ``q``."""
    name = "pk_paged_attention_bf16" if q.dtype == torch.bfloat16 else "pk_paged_attention"
    q_lens = torch.as_tensor(q_lens, dtype=torch.int64)
    q_starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)[:-1]])
    ctx_lens = torch.as_tensor(ctx_lens, dtype=torch.int64)
    tables = tables.contiguous()
    hq, d = q.shape[1], q.shape[2]
    out = torch.empty(q.shape[0], hq * d, dtype=q.dtype)
    getattr(lib, name)(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), ctx_lens.data_ptr(), q_starts.data_ptr(), q_lens.data_ptr(),
        out.data_ptr(), len(ctx_lens), hq, k_cache.shape[2], d, k_cache.shape[1], d**-0.5,
        threads,
    )  # fmt: skip
    return out


def _pool(gen, dtype, hkv=3, d=64, block_size=16, num_blocks=40):
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    return k_cache, v_cache


def test_bf16_kernel_is_the_fp32_kernel_rounded_once(isa):
    """bf16 paged attention widens its inputs exactly and runs the fp32 kernel's arithmetic:
    its output is the fp32 kernel's on the widened values, rounded to bf16 by torch's rule
    (decode tokens and prompt chunks in one call)."""
    lib = _kernel_or_skip()
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = _pool(gen, torch.bfloat16)
    ctx_lens, q_lens = [1, 37, 200, 16, 70], [1, 1, 1, 16, 30]
    tables = torch.stack([torch.randperm(40, generator=gen)[:13] for _ in ctx_lens])
    q = torch.randn(sum(q_lens), 9, 64, generator=gen).to(torch.bfloat16)
    outs = {
        dt: _paged(lib, q.to(dt), k_cache.to(dt), v_cache.to(dt), tables, ctx_lens, q_lens)
        for dt in (torch.bfloat16, torch.float32)
    }
    assert torch.equal(outs[torch.bfloat16], outs[torch.float32].to(torch.bfloat16))


@pytest.mark.parametrize("threads", [1, 3])
def test_a_rows_bits_do_not_depend_on_batch_chunking_threads_or_isa(threads, isa):
    """The kernel's contract: a query row gets the same bits whatever else is in the step, how
    its prompt is chunked (a chunk on a cached prefix, a decode token as a chunk of one), how
    many threads run and which ISA's form runs (items of more than 8 rows take the AVX-512
    form where it runs, shorter ones the AVX2 form). Checked bit for bit against the prompt
    attended whole and alone, on one thread, in the AVX2 form; and that whole-prompt result
    against the fp64 reference."""
    lib = _kernel_or_skip()
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 9, 3, 64
    k_cache, v_cache = _pool(gen, torch.float32, hkv, d)
    ctx = 150  # a prompt of 150 tokens: 10 blocks of 16, scattered
    table = torch.randperm(40, generator=gen)[:10]
    other = torch.randperm(40, generator=gen)[:10]
    q = torch.randn(ctx, hq, d, generator=gen)
    native.set_isa("avx2")
    try:
        whole = _paged(lib, q, k_cache, v_cache, table[None], [ctx], [ctx], threads=1)
    finally:
        native.set_isa(isa)
    flat_k = k_cache.view(-1, hkv, d)[[int(table[p // 16]) * 16 + p % 16 for p in range(ctx)]]
    flat_v = v_cache.view(-1, hkv, d)[[int(table[p // 16]) * 16 + p % 16 for p in range(ctx)]]
    assert torch.allclose(whole.double(), _naive(q, flat_k, flat_v, ctx, d**-0.5), atol=1e-5)
    # The prompt in chunks of 1..70 rows, each beside other sequences' decode tokens and a
    # second prompt's chunk, in varying order.
    q_other = torch.randn(64, hq, d, generator=gen)
    at = 0
    for n, first in ((70, True), (1, False), (33, True), (45, False), (1, True)):
        end = at + n
        ours = q[at:end]
        mine = [ours, q_other[:5], q_other[5:6]] if first else [q_other[:5], q_other[5:6], ours]
        lens = [(n, end), (5, 40), (1, 90)] if first else [(5, 40), (1, 90), (n, end)]
        tables = torch.stack([table if ln == (n, end) else other for ln in lens])
        out = _paged(
            lib, torch.cat(mine), k_cache, v_cache, tables, [c for _, c in lens],
            [q for q, _ in lens], threads,
        )  # fmt: skip
        rows = out[:n] if first else out[6 : 6 + n]
        assert torch.equal(rows, whole[at:end]), (n, first)
        at = end
    assert at == ctx
