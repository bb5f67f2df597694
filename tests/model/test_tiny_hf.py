"""Tiny random Llama / Qwen2 / Mistral checkpoints: our paged forward against transformers.

One teacher-forced scenario per block size: three sequences, steps mixing a prefill chunk on
top of a cached prefix with decode tokens, in varying batch order. Every new token's logits
are compared with transformers' full forward over the same sequence.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import load_model
from tests.model.helpers import Chunk, run_steps
from tests.model.tiny import make_tiny_model

MAX_LEN = 48
LENGTHS = [40, 9, 31]  # tokens of each sequence by the end of the scenario
STEPS = [
    [Chunk(0, 0, 17), Chunk(1, 0, 7), Chunk(2, 0, 29)],  # prefills (seq 0 only partly)
    [Chunk(1, 7, 8), Chunk(0, 17, 38), Chunk(2, 29, 30)],  # decode, chunk on cached prefix, decode
    [Chunk(2, 30, 31), Chunk(1, 8, 9), Chunk(0, 38, 40)],  # decodes and a 2-token chunk
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = make_tiny_model(request.param, folder)
    config, model, tokenizer = load_model(folder, progress=False)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in LENGTHS]
    with torch.no_grad():
        reference = [hf_model(torch.tensor([s])).logits[0].float() for s in sequences]
    return request.param, config, model, sequences, reference


def test_config_is_parsed_from_the_folder(tiny):
    arch, config, *_ = tiny
    assert config.architecture == arch
    assert config.attention_bias == (arch == "qwen2")
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert (config.rope_scaling is not None) == (arch == "llama")
    assert config.num_queries_per_kv == 2


@pytest.mark.parametrize("block_size", [1, 16, MAX_LEN], ids=["B1", "B16", "one-block-per-seq"])
def test_paged_logits_match_transformers(tiny, block_size):
    _, _, model, sequences, reference = tiny
    logits = run_steps(model, sequences, STEPS, block_size, MAX_LEN)
    worst = 0.0
    for chunks, step_logits in zip(STEPS, logits, strict=True):
        row = 0
        for c in chunks:
            n = c.end - c.start
            expected = reference[c.seq][c.start : c.end]
            worst = max(worst, (step_logits[row : row + n] - expected).abs().max().item())
            row += n
    assert worst < 1e-4
    assert max(r.abs().max().item() for r in reference) > 1  # logits are not all near zero
