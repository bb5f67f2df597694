"""The KV pool sized from the card (``engine/memory.py``, ``engine/card_memory.py``): the rule on
figures stubbed by hand (the second article's 80 GB budget among them), the refusals, the
profile step on the CPU, and start-up's flags and defaults."""

from __future__ import annotations

import pytest

from pagedkv.engine import EngineConfig
from pagedkv.engine.card_memory import profile_peak_bytes
from pagedkv.engine.memory import (
    CardMemory,
    check_fits_one_sequence,
    check_utilization,
    kv_bytes_from_card,
)
from pagedkv.errors import UsageError
from pagedkv.pages.layout import load_layout
from tests.model.helpers import page_of

GIB = 1 << 30


def card(total=80, available=80, weights=16, activations=4, other=0) -> CardMemory:
    return CardMemory(total * GIB, available * GIB, weights * GIB, activations * GIB, other * GIB)


def test_the_pool_is_what_the_fraction_leaves_by_hand():
    # 0.9 x 80 GiB = 72 GiB; less 16 + 4 + 1 GiB = 51 GiB.
    size = kv_bytes_from_card(card(other=1), 0.9)
    assert size.kv_bytes == 51 * GIB
    for words in ("0.9 x 80 GiB = 72 GiB", "weights 16 GiB", "activation peak 4 GiB",
                  "outside torch 1 GiB", "= 51 GiB for KV"):  # fmt: skip
        assert words in size.line, size.line


def test_the_articles_80g_budget():
    """Article 2's budget on one 80 GB card, 8B model in FP16: weights 16G + activations 4G +
    a KV pool of 58G; reserved 32k is 4G a request, "theoretically 14"; blocks at the real 6k
    are 0.75G a request, "theoretically 77". Llama-3-8B's fp16 KV record (128 KiB a token)."""
    layout = load_layout("llama-3-8b", "fp16")
    size = kv_bytes_from_card(card(), 78 / 80)  # 78 GiB, less 16 + 4: the article's 58
    assert size.kv_bytes == 58 * GIB
    reserved_blocks = size.kv_bytes // layout.block_bytes(32768)
    assert layout.block_bytes(32768) == 4 * GIB and reserved_blocks == 14
    tail = check_fits_one_sequence(size, reserved_blocks, 32768, 32768)
    assert "14 sequences of max_model_len 32768 fit" in tail
    paged_blocks = size.kv_bytes // layout.block_bytes(16)
    assert paged_blocks // (6 * 1024 // 16) == 77  # 6k-token requests in 16-token blocks


def test_two_engines_on_one_card_each_take_their_own_fraction():
    first = kv_bytes_from_card(card(total=100, available=100, weights=10, activations=2), 0.45)
    assert first.kv_bytes == 33 * GIB  # 45 - 10 - 2 (the rounding of 45 GiB is exact)
    # The second starts where the first left 55 GiB free: 0.45 fits, 0.6 does not.
    second = card(total=100, available=55, weights=10, activations=2)
    assert kv_bytes_from_card(second, 0.45).kv_bytes == 33 * GIB
    with pytest.raises(UsageError) as e:
        kv_bytes_from_card(second, 0.6)
    assert e.value.param == "gpu_memory_utilization"
    message = str(e.value)
    assert "asks for 60 GiB of the card's 100 GiB, but only 55 GiB was free" in message
    assert "give --gpu-memory-utilization 0.55 or less" in message and "\n" not in message


@pytest.mark.parametrize("value", [0, -0.1, 1.01, 2, float("nan"), True, "0.9", None])
def test_a_fraction_outside_zero_to_one_is_refused(value):
    with pytest.raises(UsageError, match=r"must be a fraction of the card's memory in \(0, 1\]"):
        check_utilization(value)
    with pytest.raises(UsageError) as e:
        EngineConfig(gpu_memory_utilization=value)
    assert e.value.param == "gpu_memory_utilization"


def test_nothing_left_for_kv_is_refused_in_one_line():
    with pytest.raises(UsageError) as e:
        kv_bytes_from_card(card(weights=16, activations=4), 0.25)  # 20 GiB, all of it taken
    message = str(e.value)
    assert "nothing is left for the KV pool" in message and "needs 20 GiB besides KV" in message
    assert "\n" not in message


def test_a_pool_that_cannot_hold_one_max_model_len_sequence_is_refused():
    size = kv_bytes_from_card(card(total=80, weights=60, activations=10), 0.9)  # 2 GiB of KV
    layout = load_layout("llama-3-8b", "fp16")  # 2 MiB a 16-token block: 1024 blocks, 16k tokens
    blocks = size.kv_bytes // layout.block_bytes(16) - 1  # the null block
    assert "7 sequences of max_model_len 2048 fit" in check_fits_one_sequence(
        size, blocks, 16, 2048
    )
    with pytest.raises(UsageError) as e:
        check_fits_one_sequence(size, blocks, 16, 32768)
    assert "1023 blocks of 16 tokens, under the 2048 one sequence of max_model_len 32768" in str(
        e.value
    )


def test_the_profile_step_runs_the_largest_step_on_the_cpu(tiny_llama):
    """The step it runs is real (it writes KV and samples); off CUDA it reports no peak. Token
    counts over, at and under one max_model_len and rows beyond the tokens all run."""
    config, model, _ = tiny_llama
    for num_tokens, max_model_len, rows in ((70, 32, 5), (64, 32, 80), (7, 32, 3)):
        page = page_of(config, 16)
        assert profile_peak_bytes(model, None, page, num_tokens, max_model_len, rows) == 0


def test_cpu_defaults_are_unchanged(make_engine):
    engine = make_engine()
    info = engine.info
    assert engine.config.kv_cache_memory_bytes is None and engine.config.cuda_graphs is None
    assert info.kv_cache_bytes <= 512 << 20 < info.kv_cache_bytes + info.record_bytes * 16 * 2
    assert info.placement() == {"device": "cpu", "dtype": "float32", "attention_backend": "native"}
    assert engine.runner.graphs is None
