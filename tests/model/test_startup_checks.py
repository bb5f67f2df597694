"""Engine start-up: what depends only on the model's shape is checked before the weights load,
and the KV pool is reported in usable blocks, the count every metric and error uses."""

from __future__ import annotations

import json

import pytest

from pagedkv.engine import startup
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.errors import UsageError
from pagedkv.model.embedded import embedded_model_path
from tests.model.tiny import COMMON, tiny_model_config

# The tiny llama: 2 layers x 2 KV heads x head dim 64 / 4 = 16, K and V, fp32 (4 bytes):
# 2 * 2 * 2 * 16 * 4 = 512 bytes per token, 8192 bytes per 16-token block.
TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16


class WeightsLoaded(Exception):
    """Raised by the patched loader: reaching it means the weights would load now."""


@pytest.fixture
def no_weight_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise WeightsLoaded

    monkeypatch.setattr(startup, "load_model", refuse)


@pytest.fixture
def config_only_folder(tmp_path):
    """A Hugging Face folder with a config.json and no weights at all."""
    (tmp_path / "config.json").write_text(json.dumps({**COMMON, "model_type": "llama"}))
    return tmp_path


def _config(model, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(model), log_startup=False, **kwargs)


def test_pool_too_small_is_refused_before_the_weights_load(no_weight_load, config_only_folder):
    with pytest.raises(
        UsageError, match="--kv-cache-memory 15.999 KiB has room for 1 block of 16 tokens"
    ) as e:
        startup.build_parts(_config(config_only_folder, kv_cache_memory_bytes=2 * 8192 - 1))
    assert e.value.param == "kv_cache_memory"
    assert "(8 KiB each, 512 B per token)" in str(e.value)
    assert "give --kv-cache-memory 16KiB or more" in str(e.value)
    # One byte more is enough for the pool: start-up goes on to load the weights.
    with pytest.raises(WeightsLoaded):
        startup.build_parts(_config(config_only_folder, kv_cache_memory_bytes=2 * 8192))


def test_a_reserved_pool_too_small_names_the_largest_max_model_len(
    no_weight_load, config_only_folder
):
    # reserved: one block is one max_model_len region, 100 x 512 bytes = 50 KiB here.
    config = _config(config_only_folder, policy="reserved", max_model_len=100,
                     kv_cache_memory_bytes=64 * 1024)  # fmt: skip
    with pytest.raises(UsageError) as e:
        startup.build_parts(config)
    assert str(e.value) == (
        "--kv-cache-memory 64 KiB has room for 1 block of 100 tokens (policy reserved: one "
        "max_model_len region per sequence, 50 KiB each, 512 B per token); the KV pool needs "
        "at least 2: give --kv-cache-memory 100KiB or more, or --max-model-len 64 or less"
    )
    # The suggestion fits: 2 regions of 64 tokens x 512 bytes = 64 KiB.
    with pytest.raises(WeightsLoaded):
        startup.build_parts(_config(config_only_folder, policy="reserved", max_model_len=64,
                                    kv_cache_memory_bytes=64 * 1024))  # fmt: skip


def test_context_beyond_the_model_is_refused_before_the_weights_load(
    no_weight_load, config_only_folder
):
    with pytest.raises(UsageError, match="max_model_len 129 exceeds the model's context of 128"):
        startup.build_parts(_config(config_only_folder, max_model_len=129))


def test_gguf_pool_check_reads_only_the_header(no_weight_load):
    # SmolLM2-135M: 30 layers x 3 KV heads x 64, K and V, fp32 = 46080 bytes per token.
    two_blocks = 2 * 16 * 2 * 30 * 3 * 64 * 4
    with pytest.raises(UsageError, match="needs at least 2"):
        startup.build_parts(_config(embedded_model_path(), kv_cache_memory_bytes=two_blocks - 1))
    with pytest.raises(WeightsLoaded):
        startup.build_parts(_config(embedded_model_path(), kv_cache_memory_bytes=two_blocks))


def test_startup_report_counts_usable_blocks_like_the_engine():
    config = EngineConfig(kv_cache_memory_bytes=91 * TINY_BLOCK_BYTES, log_startup=False)
    parts = startup.build_parts(config, loaded=(tiny_model_config(), None, None))
    # 91 physical blocks; block 0 is the null block, so 90 hold KV.
    assert parts.runner.num_blocks == 91
    assert "KV pool 90 usable blocks x 16 tokens = 1440 slots (+1 null block)" in (
        parts.startup_report
    )
    assert "91" not in parts.startup_report.split("page format")[0]
    engine = LLMEngine(config, parts=parts)
    assert engine.info.num_blocks == 90
    assert engine.snapshot().num_total_blocks == 90


def test_reserved_pool_has_no_null_block_to_report():
    config = EngineConfig(
        policy="reserved",
        max_model_len=64,
        kv_cache_memory_bytes=3 * 64 * 512,
        log_startup=False,
    )
    parts = startup.build_parts(config, loaded=(tiny_model_config(), None, None))
    assert "KV pool 3 usable blocks x 64 tokens = 192 slots, " in parts.startup_report
    assert "null" not in parts.startup_report


def test_startup_report_says_when_block_size_replaces_the_policys():
    config = EngineConfig(block_size=4, kv_cache_memory_bytes=91 * TINY_BLOCK_BYTES)
    parts = startup.build_parts(config, loaded=(tiny_model_config(), None, None))
    first = parts.startup_report.splitlines()[0]
    assert first.endswith("; its block size 16 replaced by 4)"), first
    default = startup.build_parts(
        EngineConfig(kv_cache_memory_bytes=91 * TINY_BLOCK_BYTES), (tiny_model_config(), None, None)
    )
    assert "replaced" not in default.startup_report
