"""``engine/kv/block_copy.py``: every kind of block move (swap, host tier, copy-on-write, prefix
copies of partial hits, store bodies) goes through these functions; checked against a
per-element loop written here."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.engine.kv.block_copy import (
    block_body_bytes,
    copy_rows,
    copy_slot_prefixes,
    read_blocks,
    write_blocks,
)
from pagedkv.engine.kv.mover import KVMover
from pagedkv.kvcache.tiers.contract import PrefixCopy
from pagedkv.model.kv_pool import allocate_host_kv_caches, allocate_kv_caches, copy_pool_rows
from pagedkv.pages.page_format import PageFormat
from pagedkv.sched.batch import ScheduledBatch

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 3, 2, 4, 5
PAGE = PageFormat.mha(LAYERS, HEADS, HEAD_DIM, "fp32", BLOCK_SIZE)


def pool(num_blocks: int, seed: int):
    caches = allocate_kv_caches(PAGE, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return caches


def reference(dst, dst_rows, src, src_rows):
    """What ``copy_rows`` must do, one row at a time (the source read before any write)."""
    rows = [[(k[s].clone(), v[s].clone()) for s in src_rows] for k, v in src]
    for (k, v), layer in zip(dst, rows, strict=True):
        for d, (ks, vs) in zip(dst_rows, layer, strict=True):
            k[d], v[d] = ks, vs


def same(a, b) -> bool:
    return all(
        torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True)
    )


@pytest.mark.parametrize(
    "dst_rows, src_rows",
    [
        ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]),  # one long run: slices
        ([7, 2, 5, 0], [3, 11, 9, 14]),  # scattered: gather/scatter
        ([4, 5, 6, 7, 1], [0, 1, 2, 3, 9]),  # a run and a stray, unsorted pairs allowed
        ([3, 4, 2], [6, 6, 6]),  # a source repeated (two sequences park one shared block)
    ],
)
def test_copy_rows_between_pools_matches_the_row_loop(dst_rows, src_rows):
    src, dst = pool(16, 1), pool(16, 2)
    want = [(k.clone(), v.clone()) for k, v in dst]
    reference(want, dst_rows, src, src_rows)
    before = [(k.clone(), v.clone()) for k, v in src]
    copy_rows(dst, dst_rows, src, src_rows)
    assert same(dst, want)
    assert same(src, before)  # only the destination changes


def test_copy_on_write_within_one_pool_and_into_an_uninitialised_host_pool():
    kv = pool(8, 3)
    want = [(k.clone(), v.clone()) for k, v in kv]
    reference(want, [6, 7], kv, [1, 2])
    copy_rows(kv, [6, 7], kv, [1, 2])
    assert same(kv, want)
    host = allocate_host_kv_caches(PAGE, 4)
    copy_rows(host, [3, 0], kv, [6, 7])
    assert all(torch.equal(h[3], d[6]) and torch.equal(h[0], d[7]) for hp, dp in
               zip(host, kv, strict=True) for h, d in zip(hp, dp, strict=True))  # fmt: skip


def test_copy_rows_with_nothing_to_copy_changes_nothing():
    kv = pool(4, 4)
    before = [(k.clone(), v.clone()) for k, v in kv]
    copy_rows(kv, [], kv, [])
    assert same(kv, before)


def test_block_bodies_round_trip_and_have_the_page_layouts_size():
    kv = pool(10, 5)
    # K and V of every layer: 2 * layers * block_size * heads * head_dim fp32 values.
    assert block_body_bytes(kv) == 2 * LAYERS * BLOCK_SIZE * HEADS * HEAD_DIM * 4
    ids = random.Random(0).sample(range(10), 4)
    bodies = [bytes(b) for b in read_blocks(kv, ids)]
    assert all(len(b) == block_body_bytes(kv) for b in bodies)
    other = pool(10, 6)
    write_blocks(other, [9, 8, 7, 6], bodies)
    for (k, v), (k2, v2) in zip(kv, other, strict=True):
        for s, d in zip(ids, [9, 8, 7, 6], strict=True):
            assert torch.equal(k[s], k2[d]) and torch.equal(v[s], v2[d])


PREFIX_COPIES = [PrefixCopy(1, 6, 2), PrefixCopy(4, 2, BLOCK_SIZE - 1), PrefixCopy(1, 7, 1)]


def prefix_reference(kv, copies):
    """What a partial prefix hit's copies must do, slot by slot (sources read first)."""
    want = [(k.clone(), v.clone()) for k, v in kv]
    for (k, v), (wk, wv) in zip(kv, want, strict=True):
        for src, dst, n in copies:
            for slot in range(n):
                wk[dst, slot], wv[dst, slot] = k[src, slot], v[src, slot]
    return want


def test_copy_slot_prefixes_copies_the_first_slots_and_keeps_the_rest():
    kv = pool(8, 7)
    want = prefix_reference(kv, PREFIX_COPIES)
    copy_slot_prefixes(kv, PREFIX_COPIES)
    assert same(kv, want)


@pytest.mark.parametrize("backend_copy", [False, True])
def test_the_mover_applies_prefix_copies_with_and_without_a_backend_copy(backend_copy):
    """The step's prefix copies go through the backend's ``copy_blocks`` (native and
    torch-sdpa: ``copy_pool_rows``; Triton: tests/model/triton/test_kv_write.py) or the
    mover's own slot copy, with the same result."""
    kv = pool(8, 8)
    want = prefix_reference(kv, PREFIX_COPIES)
    mover = KVMover(kv, copy_blocks=copy_pool_rows if backend_copy else None)
    mover.before_forward(ScheduledBatch(1, (), prefix_copies=tuple(PREFIX_COPIES)))
    assert same(kv, want)
