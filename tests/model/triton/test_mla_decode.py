"""The Triton MLA decode kernel (``model/triton/mla_decode.py``) and the latent record write
against a float64 reference that gathers each sequence's latent records slot by slot through
its block table and runs plain softmax attention: scores of the latent query against the
record's compressed part plus its rope part against k_pe, values the compressed part.

Under the Triton interpreter on the CPU (tests/conftest.py); with TRITON_INTERPRET=0 on a GPU
the same tests run on cuda. Block sizes 1, 3, 16 and 64 and a whole reserved region per
sequence (the tile is not the page); one pass and split-K; fp32 and bf16 pools; any rank and
rope width (each padded to a power of two and masked); more heads than one program holds."""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.errors import UsageError
from pagedkv.model.triton.mla_decode import mla_decode
from pagedkv.model.triton.mla_write import write_latents

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def make_batch(context_lens, block_size, num_heads, rank, rope, dtype, seed=0):
    """Absorbed queries ``[S, H, R + Dr]`` (a strided view), a latent pool with spare blocks
    of random records, block tables of shuffled block ids padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randn((num_blocks, block_size, 1, rank + rope), generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros((len(context_lens), max(max(blocks_per_seq), 1) + 1), dtype=torch.int32)
    taken = 0
    for row, n in enumerate(blocks_per_seq):
        tables[row, :n] = ids[taken : taken + n]
        taken += n
    wide = torch.randn((len(context_lens), 2 * num_heads, rank + rope), generator=gen)
    q = (wide / rank**0.25).to(dtype)[:, ::2]
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, pool, tables, lens)]


def reference(q, pool, tables, lens, rank, scale):
    """float64 ``[S, H, R]``: softmax over the context of (q . record) * scale, times C."""
    block_size = pool.shape[1]
    flat = pool.double().reshape(-1, pool.shape[-1]).cpu()
    out = torch.zeros((*q.shape[:2], rank), dtype=torch.float64)
    for s, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        t = torch.arange(n)
        records = flat[tables[s].cpu().long()[t // block_size] * block_size + t % block_size]
        scores = q[s].double().cpu() @ records.t() * scale  # [H, n]: latent and rope parts
        out[s] = scores.softmax(-1) @ records[:, :rank]
    return out


def check(context_lens, block_size, num_heads=4, rank=32, rope=16, dtype=torch.float32,
          num_splits=1, tol=2e-5, tile=None):  # fmt: skip
    q, pool, tables, lens = make_batch(context_lens, block_size, num_heads, rank, rope, dtype)
    scale = 0.3
    got = mla_decode(q, pool, tables, lens, scale, rank, num_splits=num_splits, tile=tile)
    assert got.shape == (len(context_lens), num_heads, rank) and got.dtype == q.dtype
    want = reference(q, pool, tables, lens, rank, scale)
    err = (got.double().cpu() - want).abs().max().item()
    assert err < tol, err
    for s, n in enumerate(context_lens):
        if n == 0:  # a padding row reads nothing: exactly zero
            assert torch.count_nonzero(got[s]) == 0


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_any_block_size_against_float64(block_size):
    check([1, 37, 70, 0, 5], block_size)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_split_k_against_float64(block_size):
    check([70, 1, 45, 0], block_size, num_splits=3)


def test_a_whole_reserved_region_per_sequence():
    """One block of max_model_len slots per sequence (the reserved policy): a tile is a slice
    of the sequence's only block."""
    check([100, 7, 128], 128)
    check([100, 7, 128], 128, num_splits=2)


def test_deepseek_dims_and_more_heads_than_a_program():
    """DeepSeek's rank 512 and rope 64; 40 heads: two programs of 32 per sequence."""
    check([20, 3], 16, num_heads=40, rank=512, rope=64, tol=5e-5)


def test_ranks_and_rope_widths_that_are_not_powers_of_two():
    check([19, 33], 3, num_heads=5, rank=48, rope=8)
    check([19, 33], 16, num_heads=5, rank=48, rope=8, num_splits=2)


def test_bf16_pool():
    """bf16 records and queries, fp32 softmax and sums: within bf16 rounding of float64."""
    check([33, 64, 1], 16, dtype=torch.bfloat16, tol=3e-2)
    check([33, 64, 1], 16, dtype=torch.bfloat16, tol=3e-2, num_splits=2, tile=16)


def test_the_write_stores_records_by_slot_and_skips_padding():
    gen = torch.Generator().manual_seed(1)
    pool = torch.zeros((4, 3, 1, 40), device=DEVICE)
    records = torch.randn((3, 40), generator=gen).to(DEVICE)
    slots = torch.tensor([7, -1, 0], dtype=torch.int64, device=DEVICE)
    write_latents(records, pool, slots)
    flat = pool.view(-1, 40).cpu()
    assert torch.equal(flat[7], records[0].cpu()) and torch.equal(flat[0], records[2].cpu())
    assert torch.count_nonzero(flat) == 2 * 40  # the padded row stored nothing


def test_a_rank_over_the_rule_is_refused():
    q, pool, tables, lens = make_batch([4], 16, 4, 1100, 16, torch.float32)
    with pytest.raises(UsageError, match="latent rank 1100 is over 1024"):
        mla_decode(q, pool, tables, lens, 0.1, 1100)
