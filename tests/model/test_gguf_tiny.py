"""Tiny random models written as GGUF the llama.cpp way, loaded by our GGUF path, against the
transformers model they were written from (F32, so the tolerance stays 1e-4)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import load_model
from pagedkv.pages.sources import load_shape
from tests.model.helpers import Chunk, run_steps
from tests.model.tiny import VOCAB_SIZE, make_tiny_model, write_tiny_gguf

STEPS = [[Chunk(0, 0, 11), Chunk(1, 0, 5)], [Chunk(1, 5, 6), Chunk(0, 11, 30)]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_written_like_llama_cpp_matches_transformers(arch, tmp_path):
    hf_model = make_tiny_model(arch, tmp_path / "hf")
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(hf_model, arch, path)
    config, model, tokenizer = load_model(path, progress=False)
    assert config.architecture == arch
    # One shape source for both files: they agree on every fact both state.
    from_gguf, from_hf = load_shape(path), load_shape(tmp_path / "hf")
    for fact in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "query_dim",
                 "vocab_size", "hidden_size", "intermediate_size", "max_context_tokens",
                 "tie_word_embeddings", "rope_theta"):  # fmt: skip
        assert getattr(from_gguf, fact) == getattr(from_hf, fact), fact
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)  # fp32
    # Parameters: the GGUF's tensor elements (+ llama3's rope_freqs factors, head_dim / 2),
    # and the config.json estimate, both against the model transformers built.
    num_params = sum(p.numel() for p in hf_model.parameters())
    assert from_hf.num_params == num_params
    assert from_gguf.num_params == num_params + (8 if arch == "llama" else 0)
    assert config.shape == from_gguf
    assert config.tie_word_embeddings == (arch in ("qwen2", "qwen3"))
    assert config.attention_bias == (arch == "qwen2")
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (30, 6)]
    with torch.no_grad():
        reference = [hf_model(torch.tensor([s])).logits[0] for s in sequences]
    logits = run_steps(model, sequences, STEPS, block_size=4, max_len=32)
    for chunks, step_logits in zip(STEPS, logits, strict=True):
        row = 0
        for c in chunks:
            n = c.end - c.start
            diff = (step_logits[row : row + n] - reference[c.seq][c.start : c.end]).abs().max()
            assert diff.item() < 1e-4, f"seq {c.seq} tokens {c.start}..{c.end}: {diff.item()}"
            row += n
    assert tokenizer.eos_token_id == 257 and tokenizer.encode("</s>") == [257]
