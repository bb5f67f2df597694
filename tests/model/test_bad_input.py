"""Bad model paths, files and shapes fail with one clear error each: a ``UsageError`` (the
user's file or flag is wrong, printed as one ``error:`` line), never an internal error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedkv.errors import UsageError
from pagedkv.model import AttentionMetadata, ModelConfig, allocate_kv_caches, load_model
from pagedkv.model.attention import AttentionPlan
from pagedkv.pages.page_format import PageFormat
from pagedkv.pages.sources import shape_from_hf_config
from tests.model.helpers import page_of
from tests.model.tiny import make_tiny_model


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope.gguf", progress=False)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(UsageError, match="not a readable GGUF"):
        load_model(path, progress=False)


def test_gguf_cut_inside_its_vocabulary(tmp_path):
    """The header's string arrays (the 49k-token vocabulary) are read in one tight loop; a file
    that ends inside them is refused in one line, by the shape reader and by the loader."""
    from pagedkv.model.embedded import embedded_model_path
    from pagedkv.pages.gguf_header import read_gguf_header

    whole = embedded_model_path().read_bytes()
    for cut in (200_000, 200_003):  # inside a string; inside a length
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(UsageError, match="not a readable GGUF.*truncated GGUF header"):
            read_gguf_header(path)
        with pytest.raises(UsageError, match="not a readable GGUF.*truncated GGUF header"):
            load_model(path, progress=False)


def test_folder_without_a_model(tmp_path):
    with pytest.raises(UsageError, match="neither config.json nor exactly one .gguf"):
        load_model(tmp_path, progress=False)


def test_unknown_architecture_in_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 8}))
    with pytest.raises(UsageError, match="unsupported model architecture 'gpt_neox'.*llama"):
        load_model(tmp_path, progress=False)


def test_unknown_architecture_in_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UsageError, match="unsupported model architecture 'falcon'"):
        load_model(path, progress=False)


def test_unsupported_dtype(tmp_path):
    with pytest.raises(UsageError, match="unsupported dtype"):
        load_model(tmp_path, dtype="float16", progress=False)


def test_checkpoint_missing_a_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama", tmp_path)
    (weights_file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights_file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights_file)
    with pytest.raises(UsageError, match=r"missing \['layers.1.up_proj.weight'\]"):
        load_model(tmp_path, progress=False)


def test_invalid_config_values():
    good = dict(
        architecture="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=3,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=16,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(**good)
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        ModelConfig(**{**good, "num_heads": 2, "vocab_size": 0})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_shape(
            shape_from_hf_config(
                {
                    "model_type": "llama",
                    "hidden_size": 8,
                    "num_attention_heads": 2,
                    "intermediate_size": 16,
                    "num_hidden_layers": 1,
                    "vocab_size": 10,
                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                },
                "tiny",
            )
        )


def _meta(context_lens, starts, tables):
    return AttentionMetadata(
        slot_mapping=torch.arange(starts[-1]),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    )


def test_attention_metadata_that_cannot_be_right():
    with pytest.raises(ValueError, match="do not cover"):
        AttentionPlan(_meta([9], [0, 9], [[0, 1]]), block_size=4)
    with pytest.raises(ValueError, match="1 <= new tokens <= context_lens"):
        AttentionPlan(_meta([2], [0, 3], [[0]]), block_size=4)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        PageFormat.mha(1, 1, 2, "fp32", block_size=0)


def test_forward_with_caches_of_another_model(tmp_path):
    make_tiny_model("qwen2", tmp_path)
    config, model, _ = load_model(tmp_path, progress=False)
    wrong = allocate_kv_caches(
        PageFormat.mha(config.num_layers, config.num_kv_heads + 1, config.head_dim, "fp32", 4), 4
    )
    meta = _meta([3], [0, 3], [[0]])
    with pytest.raises(ValueError, match="KV caches must be"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), wrong, meta)
    right = allocate_kv_caches(page_of(config, 4), 4)
    with pytest.raises(ValueError, match="must both be \\[3\\]"):
        model(torch.tensor([1, 2]), torch.arange(2), right, meta)
