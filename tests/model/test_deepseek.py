"""DeepSeek-V2 and -V3 (issue 55) on the one decoder layer: tiny random checkpoints made by
transformers (``tests/model/tiny.py``: V2 without a query low rank, softmax routing limited to
a group, one shared expert; V3 with a low rank, sigmoid routing with the score bias, two shared
experts; both YaRN, a dense first layer and two MoE layers) against transformers itself, on the
same weights: teacher-forced logits of chunked prefills (decompressed, and absorbed over a
cached prefix) and mixed decode steps within fp32 tolerance at B = 1, 16 and 64; greedy tokens
of the engine equal transformers' ``generate`` on every backend of the table."""

from __future__ import annotations

import re

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model
from pagedkv.model.layers import SwiGLU
from pagedkv.model.moe import MoE
from pagedkv.pages.backends import RULES
from tests.engine.conftest import assert_no_leaks
from tests.model.helpers import Chunk, run_steps
from tests.model.tiny import make_tiny_model

FP32_TOL = 1e-4
PROMPTS = [[200, 1, 2], list(range(30, 67)), [9, 250, 3, 77, 140, 66], [5, 17, 40, 99, 12, 7]]
NEW_TOKENS = 8
FAMILIES = ["deepseek_v2", "deepseek_v3"]


def hf_greedy(hf, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])  # the mask given: a token 0 is no padding here
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def deepseek(request, tmp_path_factory):
    """``(family, transformers model, loaded (config, model, tokenizer), folder)``."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, folder)
    return request.param, hf, load_model(folder, progress=False), folder


def test_the_config_reads_the_family(deepseek):
    family, hf, (config, model, _), _ = deepseek
    assert config.architecture == family and config.family.attention == "mla"
    dims = config.mla
    assert (dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim) == (32, 8, 16)
    assert dims.q_lora_rank == (None if family == "deepseek_v2" else 24)
    assert [type(layer.mlp) for layer in model.layers] == [SwiGLU, MoE, MoE]
    # YaRN: transformers' frequencies and cos/sin factor (V3's mscale differs from the rest)
    want = hf.model.rotary_emb
    assert torch.allclose(model.rotary.inv_freq, want.inv_freq, rtol=1e-6)
    assert model.rotary.cos_sin_scale == pytest.approx(want.attention_scaling)
    assert (want.attention_scaling != 1.0) == (family == "deepseek_v3")
    attention = hf.model.layers[0].self_attn
    assert model.layers[0].mla.scale == pytest.approx(attention.scaling, rel=1e-6)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_logits_equal_transformers_through_chunks_and_decode(deepseek, block_size):
    """Sequence 0 prefills 24 tokens fresh (decompressed), then 16 over that prefix (absorbed:
    fewer multiply-adds, ``MLADims.decompress_prefill``); sequence 1 prefills 10, then 30 over
    them (decompressed with its prefix); then both decode beside a third's whole prompt."""
    _, hf, (config, model, _), _ = deepseek
    assert not config.mla.decompress_prefill(16, 40) and config.mla.decompress_prefill(30, 40)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (44,), generator=gen).tolist() for _ in range(3)]
    steps = [
        [Chunk(0, 0, 24), Chunk(1, 0, 10)],
        [Chunk(0, 24, 40), Chunk(1, 10, 40)],
        [Chunk(0, 40, 41), Chunk(2, 0, 20), Chunk(1, 40, 41)],
        [Chunk(1, 41, 42), Chunk(0, 41, 42), Chunk(2, 20, 21)],
    ]
    got = run_steps(model, seqs, steps, block_size, max_len=64)
    with torch.no_grad():
        want = [hf(torch.tensor([s])).logits[0] for s in seqs]
    for step, logits in zip(steps, got, strict=True):
        rows = torch.cat([want[c.seq][c.start : c.end] for c in step])
        assert (logits - rows).abs().max().item() < FP32_TOL


@pytest.fixture(scope="module")
def reference(deepseek):
    _, hf, _, _ = deepseek
    return [hf_greedy(hf, p) for p in PROMPTS]


def engine_for(loaded, **overrides) -> LLMEngine:
    overrides.setdefault("log_startup", False)
    overrides.setdefault("max_model_len", 128)
    config = EngineConfig(**overrides)
    return LLMEngine(config, parts=build_parts(config, loaded))


BACKEND_CASES = [(b, bs) for b in ("native", "torch-sdpa") for bs in (1, 16, 64)]
BACKEND_CASES.append(("triton", 16))  # under Triton's interpreter: its kernel and store


@pytest.mark.parametrize(("backend", "block_size"), BACKEND_CASES)
def test_greedy_tokens_equal_transformers(deepseek, reference, backend, block_size):
    """16-token chunks: the 37-token prompt prefills in three steps beside the others' decode."""
    assert set(RULES) == {"native", "torch-sdpa", "triton"}
    _, _, loaded, _ = deepseek
    engine = engine_for(loaded, block_size=block_size, attention_backend=backend,
                        max_num_batched_tokens=16)  # fmt: skip
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_no_leaks(engine)


def test_startup_prints_the_latent_record(deepseek):
    """``record_bytes`` = layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, the same
    number the planner prices (``pages/layout.py``)."""
    _, _, loaded, folder = deepseek
    from pagedkv.pages.layout import load_layout

    engine = engine_for(loaded, block_size=16)
    report = engine.parts.startup_report
    assert "attention=mla" in report and "kv_lora_rank=32" in report
    assert re.search(rf"\brecord_bytes={3 * (32 + 8) * 4}\b", report)
    assert load_layout(folder, "fp32").record_bytes == 3 * (32 + 8) * 4
    assert engine.runner.kv_cache_bytes == engine.runner.num_blocks * 16 * 3 * 40 * 4


def test_the_native_step_reads_latent_pages_in_place(deepseek):
    """On the native backend the absorbed rows (decode rows, and a chunk the rule runs
    absorbed) go to the C paged-attention kernel, the record pool read in place as keys and
    values; a chunk the rule decompresses stays on torch ops. Each layer's attention equals
    the torch-sdpa reference's."""
    from pagedkv.model.attention_backend import make_backend
    from pagedkv.model.kv_pool import allocate_kv_caches
    from pagedkv.model.mla.native import NativeLatentStep
    from pagedkv.pages.backends import RULES
    from tests.model.helpers import BlockAssigner, page_of

    _, _, (config, model, _), _ = deepseek
    assigner = BlockAssigner(3, 64, 16)
    steps = [[Chunk(0, 0, 24), Chunk(1, 0, 10), Chunk(2, 0, 5)],
             [Chunk(0, 24, 40), Chunk(1, 10, 40), Chunk(2, 5, 6)]]  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    for backend in ("native", "torch-sdpa"):
        kv = allocate_kv_caches(page_of(config, 16), assigner.num_blocks)
        outs = []
        for chunks in steps:
            positions, meta = assigner.step(chunks)
            plan = make_backend(RULES[backend], model, model.device).plan(meta, kv, 16)
            ids = torch.randint(0, 256, (positions.numel(),), generator=gen)
            outs.append(model(ids, positions, kv, meta, 16, plan))
        if backend == "native":
            assert isinstance(plan, NativeLatentStep)
            rows = plan._rows  # the second step: sequence 1's 30-token chunk decompresses
            assert [p.stop - p.start for p in rows.decompressed] == [30]
            assert rows.q_lens.tolist() == [16, 1]  # sequence 0's absorbed chunk, 2's decode
            native_outs = outs
        gen = torch.Generator().manual_seed(4)
    for got, want in zip(native_outs, outs, strict=True):
        assert (got - want).abs().max().item() < FP32_TOL
