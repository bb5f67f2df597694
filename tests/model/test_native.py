"""pagedkv's compiled kernels (``native.py``, ``native_kernels.c``) as the model calls them:
``NativeProjection``, ``RMSNorm`` and ``SwiGLU`` with kernels, decode attention from the
paged cache. Each against a float64 reference, and bit for bit against itself alone, in a
batch and at 1-3 threads (the batch invariance the kernels promise). Then the build: cached,
rebuilt for a new source, and a clear reason whenever the torch path is taken instead."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedkv.model import native
from pagedkv.model.attention import AttentionPlan, paged_attention
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.layers import RMSNorm, SwiGLU
from pagedkv.model.native.projection import NativeProjection, native_factory
from pagedkv.pages.page_format import PageFormat

LIB = native.kernels()
needs_kernels = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _projection(k: int, n: int, bias: bool, seed: int = 0) -> NativeProjection:
    gen = _gen(seed)
    weight = torch.randn(n, k, generator=gen)
    return NativeProjection(weight, torch.randn(n, generator=gen) if bias else None)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64, 65, 130])  # 65 and up: MKL, sharded
# 18: a tail of 2 columns; 40 and 8: k % 16 == 8, the AVX-512 form's masked last step
@pytest.mark.parametrize("k, n", [(8, 4), (40, 12), (48, 18), (576, 96)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_threads", [1, 2, 3])  # 18 columns: no 3 even shards, one mm
def test_projection_its_residual_add_and_halves_match_float64(
    threads, rows, k, n, bias, num_threads, isa
):
    threads(num_threads)
    module = _projection(k, n, bias, seed=rows)
    x = torch.randn(rows, k, generator=_gen(1))
    residual = torch.randn(rows, n, generator=_gen(2))
    want = x.double() @ module.weight.double().t()
    if bias:
        want += module.bias.double()
    tol = 1e-5 * math.sqrt(k)
    assert torch.allclose(module(x).double(), want, atol=tol)
    before = residual.clone()
    assert torch.allclose(module.added_to(residual, x).double(), residual.double() + want, atol=tol)
    assert torch.equal(residual, before)  # a new tensor; the residual is not touched
    first, second = module.halves(x)
    assert torch.allclose(torch.cat([first, second], 1).double(), want, atol=tol)


@needs_kernels
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("k", [48, 56])  # 56: the AVX-512 form's masked last step
def test_each_row_is_bit_identical_alone_in_any_batch_and_at_any_thread_count(
    threads, num_threads, k, isa
):
    """One contract from one row to many (native_chain.c up to 8 rows, native_gemm.c from
    9): a decode step, a mixed step and a prompt give a row the same bits."""
    module = _projection(k, 22, bias=True)
    x = torch.randn(130, k, generator=_gen(3))
    threads(1)
    alone = [module(x[i : i + 1]) for i in range(x.shape[0])]
    threads(num_threads)
    for rows in (2, 3, 5, 8, 9, 15, 16, 17, native.MAX_ROWS, 65, 130):  # both sides of 8 and 64
        batch = module(x[:rows])
        for i in range(rows):
            assert torch.equal(batch[i], alone[i][0]), (rows, i)


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 CPU"
)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 64])
def test_the_two_forms_give_the_same_bits(rows):
    """The AVX2 and AVX-512 forms run the same chain of FMAs per element (8 or 16 columns a
    vector up to 8 rows, 16-row groups from 9): the ISA does not change what a run computes."""
    module = _projection(1024, 70, bias=True)  # 70 columns: groups of 16 (8) and a scalar tail
    x = torch.randn(rows, 1024, generator=_gen(4))
    residual = torch.randn(rows, 70, generator=_gen(5))
    before = native.isa()
    try:
        native.set_isa("avx2")
        narrow, narrow_sum = module(x), module.added_to(residual, x)
        native.set_isa("avx512")
        assert torch.equal(module(x), narrow)
        assert torch.equal(module.added_to(residual, x), narrow_sum)
    finally:
        native.set_isa(before)


@needs_kernels
def test_the_isa_is_chosen_by_rule_and_a_bad_choice_says_why(fresh_state, monkeypatch):
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setenv("PAGEDKV_NATIVE_ISA", "sse2")
    assert native.kernels() is None
    assert native.unavailable_reason().startswith("PAGEDKV_NATIVE_ISA=sse2: choose avx2")
    monkeypatch.delenv("PAGEDKV_NATIVE_ISA")
    monkeypatch.setattr(native, "_state", {})
    assert native.isa() == ("avx512" if capability == "AVX512" else "avx2")
    with pytest.raises(ValueError, match="choose from"):
        native.set_isa("neon")
    monkeypatch.setenv("PAGEDKV_NATIVE_ISA", "avx2")
    monkeypatch.setattr(native, "_state", {})
    assert native.isa() == "avx2"


@needs_kernels
def test_non_contiguous_or_other_dtype_inputs_take_torchs_path():
    module = _projection(16, 8, bias=False)
    x = torch.randn(16, 4).t()  # [4, 16], not contiguous
    assert torch.allclose(module(x), x @ module.weight.t(), atol=1e-5)
    residual = torch.randn(8, 4).t()
    assert torch.allclose(module.added_to(residual, x), residual + x @ module.weight.t(), atol=1e-5)


def test_projection_rejects_what_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="in % 8"):
        NativeProjection(torch.randn(4, 12), None)
    with pytest.raises(ValueError, match="fp32"):
        NativeProjection(torch.randn(4, 16, dtype=torch.bfloat16), None)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: the rows split between threads
def test_rms_norm_matches_float64_and_is_row_invariant(threads, rows):
    norm = RMSNorm(64, 1e-6)
    norm.weight = torch.nn.Parameter(torch.randn(64, generator=_gen(4)), requires_grad=False)
    norm.kernels = LIB
    x = torch.randn(rows, 64, generator=_gen(5)) * 3
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    threads(2)
    got = norm(x)
    assert torch.allclose(got.double(), want, atol=1e-5)
    threads(1)
    assert all(torch.equal(got[i], norm(x[i : i + 1])[0]) for i in range(rows))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 20, 70])  # 70: gate and up as two shards at 2 threads
@pytest.mark.parametrize("inter", [24, 20])  # 20: a tail of 4 past the 8-wide exp
@pytest.mark.parametrize("num_threads", [1, 2])
def test_swiglu_with_kernels_matches_torch(threads, rows, inter, num_threads):
    threads(num_threads)
    mlp = SwiGLU(16, inter)
    mlp.gate_up_proj = _projection(16, 2 * inter, bias=False, seed=6)
    down = torch.randn(16, inter, generator=_gen(7))
    mlp.down_proj = native_factory()("down", down, None)  # torch's Projection at in = 20
    x = torch.randn(rows, 16, generator=_gen(8)) * 2
    gate_up = x @ mlp.gate_up_proj.weight.t()
    want = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ down.t()
    mlp.kernels = LIB
    assert torch.allclose(mlp(x), want, rtol=1e-5, atol=1e-4)


@needs_kernels
def test_silu_of_the_whole_float_range_is_within_two_ulp():
    """The vectorised exp: small, large, huge and tiny gates (the clamp at +-88)."""
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.randn(4000, generator=_gen(13)) * 5])
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None].contiguous()
    out = torch.empty(1, gate.numel())
    n = gate.numel()
    LIB.pk_silu_mul(
        gate_up.data_ptr(), 2 * n, gate_up.data_ptr() + 4 * n, 2 * n, out.data_ptr(), 1, n, 1
    )
    want = F.silu(gate.double())
    normal = want.abs() > 1e-30
    rel = (out[0].double() - want).abs()[normal] / want.abs()[normal]
    assert rel.max() < 2.5e-7
    assert torch.isfinite(out).all()  # no overflow, no NaN
    assert out[0][~normal].abs().max() < 1e-30  # silu(-120) underflows, as it should


def _paged_decode_batch(ctx_lens, block_size=4, hq=6, hkv=2, d=16, seed=9):
    """A pool with shuffled blocks and one decode token per sequence of ``ctx_lens``."""
    gen = _gen(seed)
    need = sum(-(-c // block_size) for c in ctx_lens)
    k_cache = torch.randn(need + 3, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(need + 3, block_size, hkv, d, generator=gen)
    free = (torch.randperm(need + 2, generator=gen) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx_lens]
    width = max(map(len, tables))
    slots = [t[(c - 1) // block_size] * block_size + (c - 1) % block_size
             for t, c in zip(tables, ctx_lens, strict=True)]  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        query_start_loc=torch.arange(len(ctx_lens) + 1, dtype=torch.int32),
    )  # fmt: skip
    n = len(ctx_lens)
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    return q, k, v, (k_cache, v_cache), meta, block_size


@needs_kernels
@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_attention_is_bit_identical_alone_and_in_a_batch(threads, num_threads):
    ctx_lens = [1, 7, 13, 30, 5]
    q, k, v, kv, meta, block_size = _paged_decode_batch(ctx_lens)
    threads(num_threads)
    scale = 0.25
    batch = paged_attention(q, k, v, kv, AttentionPlan(meta, block_size, kernels=LIB), scale)
    reference = paged_attention(q, k, v, kv, AttentionPlan(meta, block_size), scale)
    assert torch.allclose(batch, reference, atol=1e-5)  # torch's gather + SDPA path
    threads(1)
    for i, ctx in enumerate(ctx_lens):
        one = AttentionMetadata(
            slot_mapping=meta.slot_mapping[i : i + 1],
            block_tables=meta.block_tables[i : i + 1],
            context_lens=torch.tensor([ctx], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        )
        alone = paged_attention(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], kv, AttentionPlan(one, block_size, kernels=LIB), scale
        )  # fmt: skip
        assert torch.equal(alone[0], batch[i]), i


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """A process state with no library loaded yet, building into an empty cache."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@needs_kernels
def test_the_build_is_cached_by_source_and_rebuilt_when_it_changes(fresh_state, monkeypatch):
    assert native.kernels() is not None
    (built,) = (fresh_state / "pagedkv" / "native").glob("*.so")
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(native, "_state", {})
    native.kernels()
    assert [p.stat().st_mtime_ns for p in built.parent.glob("*.so")] == [stamp]  # reused
    changed = fresh_state / "native_kernels.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    monkeypatch.setattr(native, "_state", {})
    assert native.kernels() is not None
    assert len(list(built.parent.glob("*.so"))) == 2


def test_a_failing_compiler_or_the_switch_gives_the_torch_path_and_says_why(
    fresh_state, monkeypatch
):
    monkeypatch.setenv("PAGEDKV_NATIVE", "0")
    assert native.kernels() is None and native.unavailable_reason() == "PAGEDKV_NATIVE=0"
    monkeypatch.delenv("PAGEDKV_NATIVE")
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CC", "false")
    assert native.kernels() is None
    reason = native.unavailable_reason()
    assert reason.startswith(("false failed", "the CPU", "the kernels are", "torch's")), reason
    assert not list((fresh_state / "pagedkv" / "native").glob("*.so"))  # no half a library


def test_set_enabled_false_loads_the_torch_projections(embedded, monkeypatch):
    from pagedkv.model import load_model
    from pagedkv.model.projection import Projection

    monkeypatch.setattr(native, "_state", dict(native._state))
    native.set_enabled(False)
    _, model, tokenizer = load_model(None, progress=False)
    assert isinstance(model.lm_head, Projection) and model.kernels is None
    assert "native kernels off" in model.weights_report
    if LIB is None:
        return
    # Both paths on the same prompt: the same greedy argmax, logits within fp32 rounding.
    _, ours, _ = embedded
    assert isinstance(ours.lm_head, NativeProjection)
    ids = torch.tensor(tokenizer.encode("The capital of France is"))
    hidden = [m.embed(ids) for m in (ours, model)]
    assert torch.equal(hidden[0], hidden[1])
    last = [m.compute_logits(m.norm(h)[-1:]) for m, h in zip((ours, model), hidden, strict=True)]
    assert torch.allclose(last[0], last[1], atol=1e-4)


def _tiny_models():
    """The same random tiny llama twice: loaded with the kernels and without."""
    from pagedkv.model.llama import build_model

    from .tiny import tiny_model_config

    config = tiny_model_config()
    gen = _gen(10)
    weights = {"embed_tokens.weight": torch.randn(config.vocab_size, 64, generator=gen) * 0.1}
    weights["norm.weight"] = torch.rand(64, generator=gen) + 0.5
    shapes = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64, "gate_proj": 96,
              "up_proj": 96}  # fmt: skip
    for i in range(config.num_layers):
        for name, rows in shapes.items():
            weights[f"layers.{i}.{name}.weight"] = torch.randn(rows, 64, generator=gen) * 0.2
        weights[f"layers.{i}.down_proj.weight"] = torch.randn(64, 96, generator=gen) * 0.2
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"layers.{i}.{norm}.weight"] = torch.rand(64, generator=gen) + 0.5
    models = []
    for enabled in (True, False):
        native.set_enabled(enabled)
        model = build_model(config)
        model.load_weights(dict(weights), torch.float32)
        models.append(model)
    native.set_enabled(True)
    assert models[0].kernels is not None and models[1].kernels is None
    return config, models


def _run_step(model, config, meta, positions, input_ids, block_size=4):
    """One forward on a fresh pool holding the same random cached contexts."""
    from pagedkv.model.kv_pool import allocate_kv_caches

    prefix = torch.randn(config.num_layers, 2, 8, block_size, 2, 16, generator=_gen(11))
    kv = allocate_kv_caches(PageFormat.mha(config.num_layers, 2, 16, "fp32", block_size), 8)
    for (k, v), (pk, pv) in zip(kv, prefix, strict=True):
        k.copy_(pk)
        v.copy_(pv)
    return model(input_ids, positions, kv, meta, block_size), kv


@needs_kernels
def test_a_model_step_with_kernels_matches_the_torch_path_kv_included():
    """A mixed step (a prompt of 5, two decodes) through a random tiny model, once with the
    kernels (RoPE + KV write in place, paged decode attention, projections, norms) and once
    with torch's ops: the same hidden states and the same K/V in every slot."""
    config, models = _tiny_models()
    # Sequence 0: a new prompt of 5 in blocks [3, 1]; 1 and 2 decode at context 7 and 3.
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([12, 13, 14, 15, 4, 22, 10]),
        block_tables=torch.tensor([[3, 1], [6, 5], [2, 0]], dtype=torch.int32),
        context_lens=torch.tensor([5, 7, 3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 5, 6, 7], dtype=torch.int32),
    )
    positions = torch.tensor([0, 1, 2, 3, 4, 6, 2])
    input_ids = torch.randint(0, config.vocab_size, (7,), generator=_gen(12))
    (out0, kv0), (out1, kv1) = (_run_step(m, config, meta, positions, input_ids) for m in models)
    assert torch.allclose(out0, out1, atol=1e-5)
    for (k0, v0), (k1, v1) in zip(kv0, kv1, strict=True):
        assert torch.allclose(k0, k1, atol=1e-5) and torch.allclose(v0, v1, atol=1e-5)


@needs_kernels
def test_a_decode_only_step_in_one_call_a_layer_is_bit_identical_to_the_separate_kernels():
    config, (model, torch_model) = _tiny_models()
    chains = model.default_backend().chains
    assert all(chain is not None for chain in chains)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 22, 10]),
        block_tables=torch.tensor([[3, 1], [6, 5], [2, 0]], dtype=torch.int32),
        context_lens=torch.tensor([6, 7, 3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
    )
    positions, input_ids = torch.tensor([5, 6, 2]), torch.tensor([7, 99, 256])
    assert AttentionPlan(meta, 4, kernels=LIB).native_decode_only
    fused, fused_kv = _run_step(model, config, meta, positions, input_ids)
    chains[:] = [None] * len(chains)  # the same backend, every layer by its ops
    separate, separate_kv = _run_step(model, config, meta, positions, input_ids)
    assert torch.equal(fused, separate)
    for (k0, v0), (k1, v1) in zip(fused_kv, separate_kv, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    reference, _ = _run_step(torch_model, config, meta, positions, input_ids)
    assert torch.allclose(fused, reference, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(
    "slots, tables, match",
    [([32], [[3, 1]], "slot_mapping"), ([-1], [[3, 1]], "slot_mapping"),
     ([5], [[8, 1]], "block_tables")],
)  # fmt: skip
def test_slots_or_blocks_outside_the_pool_are_refused_before_any_kernel_runs(slots, tables, match):
    config, (model, _) = _tiny_models()
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor([6], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match=match):
        _run_step(model, config, meta, torch.tensor([5]), torch.tensor([7]))
