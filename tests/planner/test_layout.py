"""KV record layout: record bytes by hand for every preset and dtype, configs, presets."""

from __future__ import annotations

import json

import pytest

from pagedkv.pages.kv_dtypes import get_kv_dtype
from pagedkv.pages.layout import (
    KVLayout,
    int32_max_pool_blocks,
    is_aligned,
    layout_from_record_bytes,
    load_layout,
)
from pagedkv.pages.sources import estimate_dense_num_params, list_presets, load_preset_config


def test_presets_are_listed():
    assert list_presets() == [
        "deepseek-v2-lite", "deepseek-v3", "llama-3-8b", "opt-13b", "qwen2.5-7b", "smollm2-135m"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "record_bytes"),
    [
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),  # 128 KiB: the second article's 4G per 32k
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),
        ("smollm2-135m", 2 * 30 * 3 * 64 * 2),
        ("deepseek-v3", 61 * (512 + 64) * 2),  # MLA: one latent + rope per layer, no V
    ],
)
def test_record_bytes_of_presets_in_bf16(preset, record_bytes):
    layout = load_layout(preset)
    assert layout.kv_dtype == "bf16"
    assert layout.record_bytes == record_bytes
    assert layout.block_bytes(16) == 16 * record_bytes
    assert layout.layer_block_bytes(16) * layout.num_layers == layout.block_bytes(16)


@pytest.mark.parametrize(
    ("kv_dtype", "head_vector_bytes"),
    [
        ("fp32", 128 * 4),
        ("fp16", 128 * 2),
        ("fp8", 128),
        ("mxfp8", 128 + 128 // 32),  # one 1-byte scale per 32 values
        ("fp4", 128 // 2 + 128 // 16),  # half a byte per value + one scale per 16
    ],
)
def test_kv_dtypes_on_llama(kv_dtype, head_vector_bytes):
    layout = load_layout("llama-3-8b", kv_dtype=kv_dtype)
    assert layout.record_bytes == 2 * 32 * 8 * head_vector_bytes


def test_block_scaled_dtype_pays_a_whole_scale_for_a_partial_group():
    # 40 values: 20 payload bytes (fp4) + ceil(40/16) = 3 scales.
    assert get_kv_dtype("fp4").vector_bytes(40) == 23
    assert get_kv_dtype("mxfp8").vector_bytes(40) == 42
    assert get_kv_dtype("bfloat16").name == "bf16"
    with pytest.raises(ValueError, match="unknown KV dtype 'int3'"):
        get_kv_dtype("int3")


def test_mla_with_fp8():
    assert load_layout("deepseek-v3", kv_dtype="fp8").record_bytes == 61 * 576


@pytest.mark.parametrize("preset", ["llama-3-8b", "qwen2.5-7b", "smollm2-135m"])
def test_preset_num_params_match_the_dense_estimate(preset):
    # The preset's stored count and the count derived from shapes are independent routes.
    config = load_preset_config(preset)
    assert estimate_dense_num_params(config) == config["num_params"]


def test_weight_bytes():
    assert load_layout("llama-3-8b").weight_bytes == 8_030_261_248 * 2
    assert load_layout("deepseek-v3").weight_bytes == 671_000_000_000 * 2
    assert layout_from_record_bytes(4096).weight_bytes is None


def test_hf_config_file_and_folder(tmp_path):
    config = {
        "architectures": ["MistralForCausalLM"],
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "vocab_size": 1000,
        "torch_dtype": "float32",
        "unrelated_key": [1, 2],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    for source in (tmp_path, tmp_path / "config.json"):
        layout = load_layout(source)
        assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (4, 2, 64)
        assert layout.record_bytes == 2 * 4 * 2 * 64 * 4
        # embeddings 2*1000*512 + 4 layers * (q,o 2*512*512 + k,v 2*512*128 + mlp 3*512*1024
        # + norms 2*512) + final norm 512
        per_layer = 2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1024 + 2 * 512
        assert layout.num_params == 2 * 1000 * 512 + 4 * per_layer + 512
    assert load_layout(tmp_path, kv_dtype="fp8").record_bytes == 2 * 4 * 2 * 64


def test_bad_sources_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'.*llama-3-8b"):
        load_layout("llama-9")
    with pytest.raises(ValueError, match="no such file"):
        load_layout(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read model config"):
        load_layout(tmp_path / "bad.json")
    (tmp_path / "short.json").write_text('{"num_hidden_layers": 2}')
    with pytest.raises(ValueError, match="lacks the key 'num_attention_heads'"):
        load_layout(tmp_path / "short.json")


def test_layout_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVLayout(name="x", attention="mha", num_layers=2, kv_dtype="fp16")
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout(
            name="x", attention="mha", num_layers=0, kv_dtype="fp16", num_kv_heads=1, head_dim=1
        )
    with pytest.raises(ValueError, match="attention"):
        KVLayout(name="x", attention="linear", num_layers=1, kv_dtype="fp16")
    with pytest.raises(ValueError, match="record bytes"):
        layout_from_record_bytes(0)
    with pytest.raises(ValueError, match="block_size"):
        layout_from_record_bytes(4096).block_bytes(0)


def test_int32_offset_limit_and_alignment():
    # 64 KiB blocks: 2**31 / 2**16 = 32768 blocks = exactly 2 GiB of addressable pool.
    assert int32_max_pool_blocks(64 * 1024) == 32768
    assert int32_max_pool_blocks(3) == 715_827_882  # 3 * 715827882 - 1 <= 2**31 - 1
    assert 3 * (715_827_882 + 1) - 1 > 2**31 - 1
    assert is_aligned(4096 * 16, 128)
    assert not is_aligned(216, 128)


def test_a_config_json_knows_its_query_width(tmp_path):
    # GQA: 8 query heads of 64 over 2 KV heads. The roofline's attention FLOPs need the query
    # width (8 * 64), which the first version recovered only for presets (else 2 * 64).
    from pagedkv.sim.cost_model import ModelCost

    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    layout = load_layout(tmp_path)
    assert layout.query_dim == 8 * 64
    assert ModelCost.from_layout(layout).attention_flops_per_pair == 4 * 4 * 8 * 64


def test_transformers_5_dtype_key_is_the_weight_dtype(tmp_path):
    config = {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8,
              "dtype": "float32"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_layout(tmp_path).weight_dtype == "fp32"
    assert load_layout(tmp_path).record_bytes == 2 * 1 * 2 * 4 * 4


@pytest.mark.parametrize(
    ("preset", "query_dim"),
    [("llama-3-8b", 32 * 128), ("qwen2.5-7b", 28 * 128), ("smollm2-135m", 9 * 64)],
)
def test_preset_shapes(preset, query_dim):
    from pagedkv.pages.sources import load_shape

    shape = load_shape(preset)
    assert shape.source == "preset" and shape.attention == "mha"
    assert shape.query_dim == query_dim
    assert load_layout(preset).query_dim == query_dim


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be >= 1"),
        ({"hidden_size": "64", "head_dim": None}, "hidden_size must be an integer, got '64'"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer, got 2.5"),
        ({"num_key_value_heads": True}, "num_key_value_heads must be an integer"),
        ({"max_position_embeddings": -1}, "max_position_embeddings must be >= 1"),
    ],
)
def test_a_malformed_config_json_names_the_key(tmp_path, change, words):
    from pagedkv.errors import UsageError

    config = {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 100,
        "intermediate_size": 128,
    }
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=words) as info:
        load_layout(str(tmp_path / "config.json"))
    assert "config.json" in str(info.value)  # names the file too


def test_plan_and_the_engine_share_the_head_group_rule(tmp_path):
    """5 query heads over 2 KV heads is no model: plan refuses it as the engine does."""
    from pagedkv.errors import UsageError

    config = {
        "model_type": "llama", "num_attention_heads": 5, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_size": 80, "num_hidden_layers": 2, "vocab_size": 100,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"num_heads \(5\) must be a multiple of num_kv_heads"):
        load_layout(str(tmp_path / "config.json"))
