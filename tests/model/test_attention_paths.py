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
from pagedkv.model.attention_plan import NativeDecode

HQ, HKV, D = 6, 2, 8


def _naive(q_new, k_all, v_all, ctx, scale):
    """Attention of the last ``len(q_new)`` positions of a ``ctx``-token sequence."""
    n = q_new.shape[0]
    out = torch.empty(n, HQ, D, dtype=torch.float64)
    for h in range(HQ):
        kv_head = h // (HQ // HKV)
        for i in range(n):
            pos = ctx - n + i
            scores = (k_all[: pos + 1, kv_head].double() @ q_new[i, h].double()) * scale
            out[i, h] = scores.softmax(0) @ v_all[: pos + 1, kv_head].double()
    return out.reshape(n, HQ * D)


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
    if lib is not None:
        assert isinstance(plan.decode, NativeDecode) == (decodes > 0)
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


def test_bf16_decode_kernel_is_the_fp32_kernel_rounded_once():
    """bf16 decode attention widens its inputs exactly and runs the fp32 kernel's arithmetic:
    its output is the fp32 kernel's on the widened values, rounded to bf16 by torch's rule."""
    lib = native.kernels()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, block_size, num_blocks = 9, 3, 64, 16, 40
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(torch.bfloat16)
    ctx_lens = torch.tensor([1, 37, 200, 16], dtype=torch.int64)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:13] for _ in ctx_lens])
    q = torch.randn(len(ctx_lens), hq, d, generator=gen).to(torch.bfloat16)
    outs = {}
    for name, dt in (
        ("pk_decode_attention_bf16", torch.bfloat16),
        ("pk_decode_attention", torch.float32),
    ):
        qq, kk, vv = q.to(dt), k_cache.to(dt), v_cache.to(dt)
        out = torch.empty(len(ctx_lens), hq * d, dtype=dt)
        getattr(lib, name)(
            qq.data_ptr(), qq.stride(0), kk.data_ptr(), vv.data_ptr(), tables.data_ptr(),
            tables.stride(0), ctx_lens.data_ptr(), out.data_ptr(), len(ctx_lens), hq, hkv, d,
            block_size, d**-0.5, 2,
        )  # fmt: skip
        outs[dt] = out
    assert torch.equal(outs[torch.bfloat16], outs[torch.float32].to(torch.bfloat16))
