"""Tiny random Llama / Qwen2 / Mistral / Qwen3 checkpoints: our paged forward against transformers.

One teacher-forced scenario per block size: three sequences, steps mixing a prefill chunk on
top of a cached prefix with decode tokens, in varying batch order. Every new token's logits
are compared with transformers' full forward over the same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagedkv.engine.kv.block_copy import copy_rows
from pagedkv.model import (
    AttentionMetadata,
    CausalLM,
    ModelConfig,
    allocate_kv_caches,
    load_model,
)
from tests.model.helpers import Chunk, page_of, run_steps
from tests.model.tiny import VOCAB_SIZE, make_tiny_model

MAX_LEN = 48
LENGTHS = [40, 9, 31]  # tokens of each sequence by the end of the scenario
STEPS = [
    [Chunk(0, 0, 17), Chunk(1, 0, 7), Chunk(2, 0, 29)],  # prefills (seq 0 only partly)
    [Chunk(1, 7, 8), Chunk(0, 17, 38), Chunk(2, 29, 30)],  # decode, chunk on cached prefix, decode
    [Chunk(2, 30, 31), Chunk(1, 8, 9), Chunk(0, 38, 40)],  # decodes and a 2-token chunk
]


@dataclass
class Tiny:
    arch: str
    folder: Any
    hf_model: Any
    config: ModelConfig
    model: CausalLM
    sequences: list[list[int]]
    reference: list[torch.Tensor]  # transformers' fp32 logits [len, V] per sequence


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "qwen3"])
def tiny(request, tmp_path_factory) -> Tiny:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf_model = make_tiny_model(request.param, folder)
    config, model, _ = load_model(folder, progress=False)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist() for n in LENGTHS]
    with torch.no_grad():
        reference = [hf_model(torch.tensor([s])).logits[0].float() for s in sequences]
    return Tiny(request.param, folder, hf_model, config, model, sequences, reference)


def _worst_diff(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    worst = 0.0
    for chunks, step_logits in zip(STEPS, logits, strict=True):
        row = 0
        for c in chunks:
            n = c.end - c.start
            expected = reference[c.seq][c.start : c.end]
            worst = max(worst, (step_logits[row : row + n] - expected).abs().max().item())
            row += n
    return worst


def test_config_is_parsed_from_the_folder(tiny):
    config = tiny.config
    assert config.architecture == tiny.arch
    assert config.attention_bias == (tiny.arch == "qwen2")
    assert config.tie_word_embeddings == (tiny.arch in ("qwen2", "qwen3"))
    assert (config.rope_scaling is not None) == (tiny.arch == "llama")
    assert config.num_queries_per_kv == 2


@pytest.mark.parametrize("block_size", [1, 16, MAX_LEN], ids=["B1", "B16", "one-block-per-seq"])
def test_paged_logits_match_transformers(tiny, block_size):
    logits = run_steps(tiny.model, tiny.sequences, STEPS, block_size, MAX_LEN)
    assert _worst_diff(logits, tiny.reference) < 1e-4
    assert max(r.abs().max().item() for r in tiny.reference) > 1  # not all near zero


def test_bfloat16_weights_stay_close(tiny):
    """bf16 is an option, not the reference: only a loose agreement is expected."""
    _, model, _ = load_model(tiny.folder, dtype="bfloat16", progress=False)
    assert model.dtype == torch.bfloat16
    logits = run_steps(model, tiny.sequences, STEPS, 16, MAX_LEN)
    scale = max(r.abs().max().item() for r in tiny.reference)
    assert _worst_diff(logits, tiny.reference) < 0.1 * scale


def test_forked_sequence_after_copy_on_write(tiny):
    """Two sequences share full prefix blocks; the partial last block is copied (copy_rows)
    before both write into their own copy in the same step."""
    config, model = tiny.config, tiny.model
    parent = tiny.sequences[0][:21]
    child = parent[:20] + [tiny.sequences[2][5]]  # diverges at position 20
    kv = allocate_kv_caches(page_of(config, 8), 6)
    prefill = AttentionMetadata(
        slot_mapping=torch.tensor([b * 8 + o for b in (4, 1, 3) for o in range(8)][:20]),
        block_tables=torch.tensor([[4, 1, 3]], dtype=torch.int32),
        context_lens=torch.tensor([20], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 20], dtype=torch.int32),
    )
    model(torch.tensor(parent[:20]), torch.arange(20), kv, prefill)
    copy_rows(kv, [0], kv, [3])  # the child's private copy of the partial block
    decode = AttentionMetadata(
        slot_mapping=torch.tensor([3 * 8 + 4, 0 * 8 + 4]),
        block_tables=torch.tensor([[4, 1, 3], [4, 1, 0]], dtype=torch.int32),
        context_lens=torch.tensor([21, 21], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
    )
    hidden = model(torch.tensor([parent[20], child[20]]), torch.tensor([20, 20]), kv, decode)
    logits = model.compute_logits(hidden)
    with torch.no_grad():
        expected_child = tiny.hf_model(torch.tensor([child])).logits[0, -1]
    assert (logits[0] - tiny.reference[0][20]).abs().max().item() < 1e-4
    assert (logits[1] - expected_child).abs().max().item() < 1e-4
    assert (expected_child - tiny.reference[0][20]).abs().max().item() > 1e-2  # they differ
