"""The tensor-parallel head split (vLLM's rule) and the page format of each rank, against cases
worked out by hand: which query and KV heads a rank holds, when KV heads are replicated, what
is refused, and that two sizes of one model compare equal as whole-model pages."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.errors import UsageError
from pagedkv.pages.head_split import HeadSplit, rank_layout
from pagedkv.pages.layout import mha_layout
from pagedkv.pages.page_format import PageFormat, format_differences, whole_of


def test_split_heads_divide_evenly():
    # Llama-3-8B: 32 query heads, 8 KV heads, at TP 4: ranks of 8 query heads and 2 KV heads.
    split = HeadSplit(4, 32, 8)
    assert (split.rank_heads, split.rank_kv_heads, split.kv_replicas) == (8, 2, 1)
    assert [split.heads(r) for r in range(4)] == [
        range(0, 8),
        range(8, 16),
        range(16, 24),
        range(24, 32),
    ]
    assert [split.kv_heads(r) for r in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]
    assert split.owners() == [0, 1, 2, 3]


def test_kv_heads_replicated_when_ranks_outnumber_them():
    # 32 query heads over 16 ranks, 8 KV heads: each KV head on 2 ranks; query heads 2r, 2r+1
    # read KV head r // 2 (group of 4 query heads per KV head: heads 0-3 -> KV head 0).
    split = HeadSplit(16, 32, 8)
    assert (split.rank_heads, split.rank_kv_heads, split.kv_replicas) == (2, 1, 2)
    assert [split.kv_heads(r).start for r in range(16)] == [r // 2 for r in range(16)]
    assert split.owners() == list(range(0, 16, 2))
    # Multi-query (1 KV head) at TP 2: both ranks hold head 0.
    mqa = HeadSplit(2, 4, 1)
    assert [mqa.kv_heads(r) for r in (0, 1)] == [range(0, 1), range(0, 1)]
    assert mqa.owners() == [0]


@pytest.mark.parametrize(
    ("tp", "heads", "kv", "words"),
    [
        (2, 9, 3, "does not divide the model's 9 query heads"),  # the embedded SmolLM2 at TP 2
        (4, 12, 6, "neither divides the model's 6 KV heads nor is a multiple of them"),
        (0, 8, 8, "must be a whole number >= 1"),
    ],
)
def test_sizes_that_do_not_split_are_refused_in_one_line(tp, heads, kv, words):
    with pytest.raises(UsageError, match=words) as err:
        HeadSplit(tp, heads, kv)
    assert "\n" not in str(err.value) and err.value.param == "tensor_parallel_size"


def test_the_refusal_names_the_sizes_that_work():
    with pytest.raises(UsageError, match=r"sizes that do: 1, 3, 9\)"):
        HeadSplit(2, 9, 3)


def test_rank_layout_holds_a_ranks_heads():
    whole = mha_layout(30, 3, 64, "fp32")  # the embedded model's KV: 3 heads of 64
    rank = rank_layout(whole, 3, num_heads=9)
    assert rank.num_kv_heads == 1 and rank.record_bytes * 3 == whole.record_bytes
    assert rank_layout(whole, 1) is whole
    with pytest.raises(UsageError):
        rank_layout(whole, 2, num_heads=9)


def test_page_format_of_each_rank_and_back():
    whole = PageFormat.mha(
        num_layers=2, num_kv_heads=4, head_dim=16, kv_dtype="fp32", block_size=16
    )
    assert (whole.tp_size, whole.kv_head_start, whole.model_kv_heads) == (1, 0, 4)
    ranks = [whole.for_rank(HeadSplit(2, 8, 4), r) for r in (0, 1)]
    assert [(p.kv_head_start, p.num_kv_heads, p.tp_size) for p in ranks] == [(0, 2, 2), (2, 2, 2)]
    # K and V, 2 layers, 2 heads of 16 fp32 values: 2 * 2 * 2 * 16 * 4 bytes.
    assert ranks[0].record_bytes == 512 and whole.record_bytes == 1024
    assert ranks[1].whole() == whole
    assert PageFormat.from_dict(ranks[1].to_dict()) == ranks[1]


def test_two_sizes_of_one_model_match_across_ranks_only():
    whole = PageFormat.mha(2, 4, 16, "fp32", 16)
    rank = whole.for_rank(HeadSplit(2, 8, 4), 0)
    straight = {name for name, _, _ in format_differences(rank.to_dict(), whole.to_dict())}
    assert straight == {"num_kv_heads", "record_bytes", "tp_size"}
    assert format_differences(rank.to_dict(), whole.to_dict(), across_ranks=True) == []
    # Another model's heads still differ, whatever the split.
    other = PageFormat.mha(2, 2, 16, "fp32", 16)
    diffs = format_differences(rank.to_dict(), other.to_dict(), across_ranks=True)
    assert [name for name, _, _ in diffs] == ["num_kv_heads", "record_bytes", "model_kv_heads"]


def test_whole_of_leaves_a_peers_nonsense_to_the_comparison():
    rank = PageFormat.mha(2, 4, 16, "fp32", 16).for_rank(HeadSplit(2, 8, 4), 1)
    bad = {**rank.to_dict(), "num_kv_heads": 0}
    assert whole_of(bad)["num_kv_heads"] == 0  # no division by zero, and it differs below
    assert format_differences(
        bad, PageFormat.mha(2, 4, 16, "fp32", 16).to_dict(), across_ranks=True
    )


def test_one_ranks_format_holds_every_head_whatever_it_is_made_from():
    whole = PageFormat.mha(2, 4, 16, "fp32", 16)
    assert dataclasses.replace(whole, num_kv_heads=3).model_kv_heads == 3
    assert whole_of({**whole.to_dict(), "num_kv_heads": 3})["num_kv_heads"] == 3
