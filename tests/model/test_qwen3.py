"""Qwen3, the proof that a family is a row of the table (issue 54): per-head RMSNorm of Q and K
before RoPE, and a head_dim (32) apart from hidden / heads (16). A tiny random checkpoint made
by transformers runs on every backend of pagedkv's table (native, torch-sdpa, and Triton under
its interpreter) and gives transformers' own greedy tokens at B = 1 and 16, through prefill,
chunked prefill and decode. transformers has no paged cache: its greedy ``generate`` over the
whole sequence is the independent reference; ``test_tiny_hf.py`` holds its logits to
transformers' within 1e-4 at B = 1, 16 and 48 besides."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model
from pagedkv.pages.backends import RULES
from tests.engine.conftest import assert_no_leaks
from tests.model.tiny import make_tiny_model

# Prompts whose greedy continuations vary (a random model often repeats one token).
PROMPTS = [[200, 1, 2], list(range(30, 67)), [9, 250, 3, 77, 140, 66], [5, 17, 40, 99, 12, 7]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    hf = make_tiny_model("qwen3", folder)
    with torch.no_grad():
        reference = []
        for prompt in PROMPTS:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
            reference.append(out[0, len(prompt) :].tolist())
    return load_model(folder, progress=False), reference


def test_the_config_names_the_family_and_its_head_dim(qwen3):
    (config, model, _), _ = qwen3
    assert config.architecture == "qwen3" and config.family.qk_norm
    assert config.head_dim == 32 and config.hidden_size // config.num_heads == 16
    assert all(layer.q_norm is not None for layer in model.layers)


@pytest.mark.parametrize("backend", list(RULES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_tokens_equal_transformers_on_every_backend(qwen3, backend, block_size):
    loaded, reference = qwen3
    # 16-token chunks: the 37-token prompt prefills in three steps, beside the others' decode.
    config = EngineConfig(log_startup=False, max_model_len=128, block_size=block_size,
                          attention_backend=backend, max_num_batched_tokens=16)  # fmt: skip
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    assert engine.parts.placement.attention_backend == backend
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_no_leaks(engine)
