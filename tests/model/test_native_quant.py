"""Weights kept in GGUF blocks on pagedkv's kernels (``native/quant.py``, ``native_dequant.h``,
``native_chain.c``, ``native_gemm.c``). References: the ``gguf`` package's own quantizer and decoder
(llama.cpp's formats, written by others), float64 products, and the fp32 kernel itself, which
the block kernel must match bit for bit on weights that are exactly block values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedkv.model import native
from pagedkv.model.native.projection import NativeProjection
from pagedkv.model.native.quant import NativeQuantProjection, encode_q4_1, encode_q8_0

pytestmark = pytest.mark.skipif(
    native.kernels() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
ENCODE = {"q4_1": encode_q4_1, "q8_0": encode_q8_0}


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
    w[0, :32] = 0.37  # a constant group: d = 0
    return w


def _block_exact(fmt: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """gguf's blocks of random weights and the fp32 weights they decode to (gguf's decoder)."""
    raw = gguf.quants.quantize(_weights(rows, cols, seed), TYPES[fmt])
    decoded = gguf.quants.dequantize(raw, TYPES[fmt]).reshape(rows, cols)
    return raw.reshape(rows, -1), torch.from_numpy(np.ascontiguousarray(decoded))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_decoded_blocks_are_encoded_back_to_the_same_bytes(fmt, isa):
    """Each decoder form (the AVX-512 one picks Q4_1 values from a table of a block's 16) gives
    gguf's values."""
    raw, decoded = _block_exact(fmt, 48, 160, seed=1)
    assert np.array_equal(ENCODE[fmt](decoded).numpy(), raw)
    module = NativeQuantProjection(fmt, decoded, None)
    assert torch.equal(module.dense_weight(), decoded)  # the kernel's decoder is gguf's


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_encoding_any_weights_errs_by_at_most_half_a_step(fmt):
    w = torch.from_numpy(_weights(40, 96, seed=2))
    blocks = ENCODE[fmt](w).numpy()
    back = gguf.quants.dequantize(blocks.reshape(-1), TYPES[fmt]).reshape(40, 96)
    groups = w.view(40, 3, 32)
    if fmt == "q4_1":  # steps of d = (max - min) / 15, from m = min (both fp16)
        step = (groups.amax(-1) - groups.amin(-1)) / 15
        slack = groups.amin(-1).abs() * 2**-11 + step * 2**-10  # fp16 rounding of m and d
    else:  # steps of d = max |w| / 127
        step = groups.abs().amax(-1) / 127
        slack = groups.abs().amax(-1) * 2**-10
    err = (torch.from_numpy(back).view(40, 3, 32) - groups).abs().amax(-1)
    assert bool((err <= step / 2 + slack + 1e-7).all())


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 65, 200])
def test_products_equal_the_fp32_kernel_on_the_decoded_weights(fmt, rows, threads, isa):
    threads(2)
    _, w = _block_exact(fmt, 70, 96, seed=rows)  # 70 outputs: a tail of 2 beyond blocks of 4
    bias = torch.randn(70, generator=torch.Generator().manual_seed(3))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    ours, fp32 = NativeQuantProjection(fmt, w, bias), NativeProjection(w.clone(), bias)
    want = x.double() @ w.double().t() + bias.double()
    got = ours(x)
    assert (got.double() - want).abs().max() < 1e-4
    residual = torch.randn(rows, 70)
    summed = ours.added_to(residual, x)
    assert (summed.double() - (want + residual.double())).abs().max() < 1e-4
    # the same kernel code (pk_linear's, or above 64 rows pk_gemm's): bit for bit
    assert torch.equal(got, fp32(x)) and torch.equal(summed, fp32.added_to(residual, x))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("span_kb", ["1", "100", "100000"])  # a panel a span, two, all rows
def test_prompts_decode_tile_by_tile_to_the_fp32_gemms_bits(
    fmt, span_kb, threads, isa, monkeypatch
):
    """Above 64 rows the blocks are decoded a tile's weight rows at a time, once per span of x
    (its size set by the L2, here forced), never as a whole matrix: the fp32 GEMM's bits on
    gguf's decoded weights whatever the span and the thread count, bias and residual too."""
    monkeypatch.setenv("PAGEDKV_GEMM_SPAN_KB", span_kb)
    _, w = _block_exact(fmt, 45, 256, seed=9)  # 45 outputs: tiles of 8 (or 6) and scalar ones
    bias = torch.randn(45, generator=torch.Generator().manual_seed(10))
    x = torch.randn(500, 256, generator=torch.Generator().manual_seed(11))
    residual = torch.randn(500, 45, generator=torch.Generator().manual_seed(12))
    ours, fp32 = NativeQuantProjection(fmt, w, bias), NativeProjection(w.clone(), bias)
    ours.dense_weight = None  # the whole matrix is not what the prompts read
    want = x.double() @ w.double().t() + bias.double()
    assert (ours(x).double() - want).abs().max() < 1e-4
    for count in (1, 2, 3):
        threads(count)
        assert torch.equal(ours(x), fp32(x)), count
        assert torch.equal(ours.added_to(residual, x), fp32.added_to(residual, x)), count


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_row_is_the_same_bits_alone_in_any_batch_and_at_any_thread_count(fmt, threads, isa):
    _, w = _block_exact(fmt, 64, 128, seed=4)
    module = NativeQuantProjection(fmt, w, None)
    batch = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    threads(1)
    alone = module(batch[17:18])
    for count in (1, 2, 3):
        threads(count)
        for rows in (slice(17, 18), slice(16, 20), slice(0, 33), slice(0, 64)):
            out = module(batch[rows])
            assert torch.equal(out[17 - rows.start], alone[0]), (count, rows)


def test_halves_of_a_gate_up_product():
    _, w = _block_exact("q4_1", 64, 96, seed=6)
    module = NativeQuantProjection("q4_1", w, None)
    for rows in (3, 100):  # the kernel, and above MAX_ROWS the dequantized GEMM
        x = torch.randn(rows, 96)
        first, second = module.halves(x)
        want = x.double() @ w.double().t()
        assert (first.double() - want[:, :32]).abs().max() < 1e-4
        assert (second.double() - want[:, 32:]).abs().max() < 1e-4


def test_bad_shapes_and_formats_are_refused():
    with pytest.raises(ValueError, match="in_features % 32"):
        NativeQuantProjection("q4_1", torch.zeros(8, 40), None)
    with pytest.raises(ValueError, match="q5_0"):
        NativeQuantProjection("q5_0", torch.zeros(8, 64), None)
    assert NativeQuantProjection("q4_1", torch.zeros(8, 64), None).nbytes == 8 * 2 * 20


def _round_to_blocks(hf_model, tied: bool) -> None:
    """Every projection weight made exactly Q4_1 values, the output head Q8_0 values (gguf's
    quantizer and decoder): what a GGUF file's weights are once decoded."""
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            head = name.endswith(("lm_head.weight", "embed_tokens.weight"))
            if p.dim() != 2 or (head and not (tied or "lm_head" in name)):
                continue
            fmt = "q8_0" if head else "q4_1"
            raw = gguf.quants.quantize(p.detach().numpy(), TYPES[fmt])
            p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, TYPES[fmt]).reshape(p.shape)))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied head + q/k/v bias; untied head
def test_int4_on_block_exact_weights_is_the_fp32_model_bit_for_bit(
    arch, tmp_path, monkeypatch, isa
):
    from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedkv.engine.startup import build_parts
    from pagedkv.model import load_model
    from tests.model.helpers import Chunk, run_steps
    from tests.model.tiny import make_tiny_model

    hf = make_tiny_model(arch, tmp_path)
    _round_to_blocks(hf, tied=hf.config.tie_word_embeddings)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    reference = load_model(tmp_path, progress=False)
    quantized = load_model(tmp_path, progress=False, weights="int4")
    report = quantized[1].weights_report
    assert report.count("q4_1 blocks") >= 3 and "q8_0 blocks" in report, report
    chains = quantized[1].default_backend().chains
    assert all(chain is not None for chain in chains)  # the one-call layer too
    ids = [[(7 * i + 3) % 250 + 5 for i in range(21)], [(11 * i + 1) % 250 + 5 for i in range(9)]]
    steps = [[Chunk(0, 0, 19), Chunk(1, 0, 8)], [Chunk(0, 19, 20), Chunk(1, 8, 9)],
             [Chunk(0, 20, 21)]]  # a mixed step, then decode-only steps  # fmt: skip
    got = run_steps(quantized[1], ids, steps, block_size=16, max_len=32)
    want = run_steps(reference[1], ids, steps, block_size=16, max_len=32)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for loaded in (reference, quantized):
        config = EngineConfig(log_startup=False, max_model_len=128)
        engine = LLMEngine(config, parts=build_parts(config, loaded))
        tokens.append([o.outputs[0].token_ids for o in engine.generate(ids, greedy)])
    assert tokens[0] == tokens[1]


def test_without_the_kernels_torchs_int_kernel_takes_the_models_activations(monkeypatch):
    from pagedkv.model.quant import QuantizingFactory, QuantProjection

    monkeypatch.setattr(native, "_state", {"off": True})
    factory = QuantizingFactory("int4", torch.float32)
    _, w = _block_exact("q4_1", 32, 64)
    module = factory("layers.0.mlp.down_proj", w, None)
    assert isinstance(module, QuantProjection) and module.act_dtype == torch.float32
    assert list(factory.choices.values()) == ["float32"]
