"""The embedded SmolLM2 (GGUF Q4_1, dequantized) against transformers on the same file, fp32.

Both sides get the same token ids (our tokenizer's); transformers decodes with its own KV
cache, we decode through the paged cache, all five prompts batched in every step.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.model.helpers import greedy_paged

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 32
CHATS = [
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "List three prime numbers greater than 100.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
]


def _prompts(tokenizer) -> list[list[int]]:
    chats = [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    return chats + [tokenizer.encode(r) for r in RAW]


def _hf_greedy(hf_model, prompt: list[int], num_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Plain greedy with transformers' own cache; no EOS handling, so exactly N tokens."""
    # transformers 5 renamed `past_key_values` to `cache`; accept either spelling.
    key = (
        "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    )
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        prefill_logits = out.logits[0].float()
        tokens = [int(prefill_logits[-1].argmax())]
        for _ in range(num_new_tokens - 1):
            out = hf_model(torch.tensor([[tokens[-1]]]), use_cache=True, **{key: getattr(out, key)})
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, prefill_logits


@pytest.fixture(scope="module")
def hf_reference(embedded, hf_embedded):
    _, _, tokenizer = embedded
    return [_hf_greedy(hf_embedded, p, NUM_NEW_TOKENS) for p in _prompts(tokenizer)]


@pytest.mark.parametrize("block_size", [16, 7])
def test_greedy_tokens_and_prefill_logits_match_transformers(embedded, hf_reference, block_size):
    _, model, tokenizer = embedded
    prompts = _prompts(tokenizer)
    ours, prefill_logits = greedy_paged(model, prompts, NUM_NEW_TOKENS, block_size)
    for i, (hf_tokens, hf_logits) in enumerate(hf_reference):
        assert ours[i] == hf_tokens, (
            f"prompt {i}: {tokenizer.decode(ours[i])!r} vs {tokenizer.decode(hf_tokens)!r}"
        )
        diff = (prefill_logits[i] - hf_logits).abs().max().item()
        # Logits over every prompt position, not only the last: a wrong Q/K layout still
        # picks the right first token but shifts these by whole units.
        assert diff < 1e-3, f"prompt {i}: prefill logits differ by {diff}"
        assert hf_logits.abs().max().item() > 5  # the comparison is not between near-zeros


def test_greedy_answers_are_sensible(embedded, hf_reference):
    """A smoke check on the text itself: the capital question gets Paris."""
    _, _, tokenizer = embedded
    assert "Paris" in tokenizer.decode(hf_reference[0][0])


def test_dequantized_weights_equal_transformers(embedded, hf_embedded):
    """Same file, same dequantizer: every weight must be bit-identical, Q/K rows included."""
    config, model, _ = embedded
    hf_layers = hf_embedded.model.layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for ours, theirs in zip(model.layers, hf_layers, strict=True):
        qkv = ours.qkv_proj.dense_weight()  # [out, in], however it is stored
        assert torch.equal(qkv[:q], theirs.self_attn.q_proj.weight)
        assert torch.equal(qkv[q : q + kv], theirs.self_attn.k_proj.weight)
        assert torch.equal(qkv[q + kv :], theirs.self_attn.v_proj.weight)
        assert torch.equal(ours.o_proj.dense_weight(), theirs.self_attn.o_proj.weight)
        gate, up = ours.mlp.gate_up_proj.dense_weight().split(config.intermediate_size)
        assert torch.equal(gate, theirs.mlp.gate_proj.weight)
        assert torch.equal(up, theirs.mlp.up_proj.weight)
        assert torch.equal(ours.mlp.down_proj.dense_weight(), theirs.mlp.down_proj.weight)
    # Tied: one [hidden, vocab] table serves the lm_head and (by columns) the embedding.
    assert model.embed_tokens is None
    assert torch.equal(model.lm_head.dense_weight(), hf_embedded.model.embed_tokens.weight)
    ids = torch.tensor([0, 17, 49151])
    assert torch.equal(model.embed(ids), hf_embedded.model.embed_tokens(ids))


def test_chunked_prefill_of_a_long_prompt_matches_transformers(embedded, hf_embedded):
    """700 tokens prefilled in three chunks, each on top of the cached ones, beside a decode."""
    from tests.model.helpers import Chunk, run_steps

    _, model, tokenizer = embedded
    paragraph = (
        "Paged attention stores the keys and values of every sequence in fixed-size blocks. "
        "A block table maps each sequence's logical blocks to physical ones, 1 to 1024. "
    )
    long_ids = tokenizer.encode(paragraph * 40)[:700]
    short_ids = tokenizer.encode("Once upon a time")
    steps = [
        [Chunk(0, 0, 300), Chunk(1, 0, 3)],
        [Chunk(1, 3, 4), Chunk(0, 300, 600)],
        [Chunk(0, 600, 700)],
    ]
    logits = run_steps(model, [long_ids, short_ids], steps, block_size=16, max_len=704)
    with torch.no_grad():
        expected = hf_embedded(torch.tensor([long_ids])).logits[0]
    ours = torch.cat([logits[0][:300], logits[1][1:], logits[2]])
    assert (ours - expected).abs().max().item() < 1e-3
