"""Re-paging block bodies between block sizes, against bodies built by hand."""

from __future__ import annotations

import struct

import pytest

from pagedkv.disagg.relayout import repage

ROW = 4  # bytes per token row: one uint32 naming (segment, token)
SEGMENTS = 6  # 3 layers x K, V


def body(block: int, block_size: int) -> bytes:
    """The body of block ``block``: segment s, token t's row holds s * 10_000 + t."""
    return b"".join(
        struct.pack("<I", s * 10_000 + block * block_size + i)
        for s in range(SEGMENTS)
        for i in range(block_size)
    )


@pytest.mark.parametrize(("src", "dst", "num_src"), [(16, 32, 4), (128, 16, 2), (16, 48, 7),
                                                     (1, 16, 40), (16, 16, 3)])  # fmt: skip
def test_repage_equals_the_destination_layout_built_directly(src, dst, num_src):
    bodies = [body(b, src) for b in range(num_src)]
    got = repage(bodies, src, dst, SEGMENTS, ROW)
    assert len(got) == num_src * src // dst  # only full destination blocks
    assert got == [body(j, dst) for j in range(len(got))]


def test_too_few_tokens_for_one_destination_block():
    assert repage([body(0, 16)], 16, 32, SEGMENTS, ROW) == []
