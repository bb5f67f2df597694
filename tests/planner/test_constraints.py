"""Backend constraints, block-size resolution with its rewrites, and the page-format fingerprint."""

from __future__ import annotations

import pytest

from pagedkv.pages.layout import layout_from_record_bytes, load_layout
from pagedkv.pages.page_format import PageFormat
from pagedkv.planner.constraints import (
    BACKENDS,
    Backend,
    constraint_violations,
    resolve_block_size,
)

LLAMA = load_layout("llama-3-8b")
MLA = load_layout("deepseek-v3")


def test_the_articles_backend_table_is_present():
    # SGLang's table in the article: backend -> (allowed page sizes, adjusted to)
    article = {
        "flashmla": ((64,), 64),
        "trtllm-mla": ((32, 64), 64),
        "tokenspeed-mla": ((32, 64), 64),
        "cutedsl-mla": ((32, 64), 64),
        "trtllm-mha": ((16, 32, 64, 128), 64),
        "hpc-ops": ((64,), 64),
        "fa4": ((128,), 128),
    }
    for name, (sizes, fallback) in article.items():
        assert BACKENDS[name].allowed_block_sizes == sizes
        assert BACKENDS[name].fallback_block_size == fallback
    assert BACKENDS["deepinfer"].allowed_block_sizes == (128,)
    assert BACKENDS["deepinfer"].alignment_bytes == 128
    assert all(BACKENDS["torch-sdpa"].allows(b) for b in (1, 7, 16, 1000))


def test_no_value_takes_the_backend_default_and_says_so():
    resolution = resolve_block_size(None, "torch-sdpa", LLAMA)
    assert resolution.block_size == 16
    assert resolution.rewrites == [(None, 16, "no block size given: torch-sdpa default")]


def test_user_value_kept_when_allowed():
    resolution = resolve_block_size(7, "torch-sdpa", LLAMA)
    assert (resolution.block_size, resolution.rewrites) == (7, [])
    assert resolution.log_line() == "block_size=7 tokens (backend torch-sdpa)"


def test_flashmla_forces_64_like_vllm_and_sglang():
    resolution = resolve_block_size(16, "flashmla", MLA)
    assert resolution.block_size == 64
    assert resolution.rewrites == [(16, 64, "flashmla only supports 64")]
    assert "16 -> 64: flashmla only supports 64" in resolution.log_line()


def test_trtllm_mha_and_fa4_rewrites():
    assert resolve_block_size(8, "trtllm-mha", LLAMA).block_size == 64
    assert resolve_block_size(128, "trtllm-mha", LLAMA).rewrites == []
    assert resolve_block_size(None, "fa4", LLAMA).block_size == 128


def test_backend_that_cannot_read_the_layout_is_an_error():
    with pytest.raises(ValueError, match="flashmla cannot read the MHA layout"):
        resolve_block_size(64, "flashmla", LLAMA)
    with pytest.raises(ValueError, match="fa4 cannot read the MLA layout"):
        resolve_block_size(128, "fa4", MLA)


def test_bad_requests():
    with pytest.raises(ValueError, match=">= 1"):
        resolve_block_size(0, "torch-sdpa", LLAMA)
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'"):
        resolve_block_size(16, "cudnn", LLAMA)


def test_alignment_rewrites_to_the_smallest_aligned_block(monkeypatch):
    # 24-byte records need B=16 for a 128-byte aligned block base (16 * 24 = 384 = 3 * 128).
    monkeypatch.setitem(BACKENDS, "aligned", Backend("aligned", 1, alignment_bytes=128))
    resolution = resolve_block_size(1, "aligned", layout_from_record_bytes(24))
    assert resolution.block_size == 16
    ((old, new, reason),) = resolution.rewrites
    assert (old, new) == (1, 16)
    assert "128-byte base alignment" in reason


def test_alignment_of_odd_records_needs_the_whole_alignment(monkeypatch):
    # 1-byte (or any odd) records align to 128 bytes only at multiples of 128 tokens.
    monkeypatch.setitem(BACKENDS, "aligned", Backend("aligned", 1, alignment_bytes=128))
    assert resolve_block_size(1, "aligned", layout_from_record_bytes(1)).block_size == 128
    assert resolve_block_size(129, "aligned", layout_from_record_bytes(3)).block_size == 256
    # 24-byte records align every 16 tokens: 20 -> 32
    assert resolve_block_size(20, "aligned", layout_from_record_bytes(24)).block_size == 32


def test_int32_offset_limit(monkeypatch):
    monkeypatch.setitem(BACKENDS, "i32", Backend("i32", 16, int32_offsets=True))
    layout = layout_from_record_bytes(4096)  # 64 KiB blocks at B=16: 32768 blocks fit int32
    assert resolve_block_size(16, "i32", layout, num_blocks=32768).rewrites == []
    # A larger block only makes a fixed block count overflow sooner: refuse, say why.
    with pytest.raises(ValueError, match="32769 blocks overflow int32 byte offsets"):
        resolve_block_size(16, "i32", layout, num_blocks=32769)


def test_deepinfer_128_always_aligns():
    # Any whole-byte record times 128 tokens is a multiple of 128 bytes: the article's point.
    for record_bytes in (1, 3, 890):
        layout = layout_from_record_bytes(record_bytes)
        assert constraint_violations(128, BACKENDS["deepinfer"], layout) == []
        assert resolve_block_size(None, "deepinfer", layout).block_size == 128
    # The article's DeepInfer block: 128 compressed records of 890 B, about 111 KiB.
    assert layout_from_record_bytes(890).block_bytes(128) / 1024 == 111.25


def test_page_format_fingerprint():
    here = PageFormat.from_layout(LLAMA, 16)
    assert here.record_bytes == 131072
    here.check_compatible(
        PageFormat.from_layout(load_layout("llama-3-8b", kv_dtype="bfloat16"), 16)
    )
    with pytest.raises(ValueError) as excinfo:
        here.check_compatible(PageFormat.from_layout(load_layout("llama-3-8b", kv_dtype="fp8"), 64))
    message = str(excinfo.value)
    assert "block_size 16 here vs 64 there" in message
    assert "kv_dtype bf16 here vs fp8 there" in message
    assert PageFormat.from_dict(here.to_dict()) == here
    with pytest.raises(ValueError, match="page format keys differ"):
        PageFormat.from_dict({**here.to_dict(), "extra": 1})
