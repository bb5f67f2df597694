"""The whole engine on the Triton backend (interpreted on the CPU) against the native CPU path:
the same greedy tokens through prefill, chunked prefill, prefix hits, decode and copy-on-write
forks; the start-up report names what runs; CUDA-graph replays (a CPU stand-in for the graph
object) give the eager step's logits and write nothing for their padding rows."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model.attention_backend import LayerOps
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.layers import rotated_qkv
from pagedkv.model.triton.attention import TritonPlan
from tests.engine.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def tiny_long_model(tmp_path_factory):
    """A tiny random Llama's folder (loaded in each test's dtype)."""
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama-fused")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pagedkv.model import load_model
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", folder)
    return load_model(folder, progress=False)


def _engine(tiny, **overrides) -> LLMEngine:
    overrides.setdefault("log_startup", False)
    config = EngineConfig(max_model_len=128, kv_cache_memory_bytes=1 << 20, **overrides)
    return LLMEngine(config, parts=build_parts(config, tiny))


SYSTEM = list(range(40, 76))  # 36 tokens: two full blocks of 16 shared, then a partial one
PROMPTS = [
    [7] * 15,  # B - 1
    [8] * 16,  # B
    [9] * 17,  # B + 1
    SYSTEM + [3, 4, 5],
    SYSTEM + [6],  # a prefix hit on the first two blocks once the one above is cached
]


def _tokens(engine: LLMEngine, prompts, n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=n)
    outs = engine.generate(prompts, params)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize(("policy", "block_size"), [("vllm", 16), ("vllm", 1), ("reserved", None)])
def test_greedy_tokens_equal_the_native_cpu_path(tiny, policy, block_size):
    """B = 16, SGLang's page of 1 and a reserved max_model_len region (128 tokens) on the
    Triton backend. A 20-token budget chunks the 39-token prompt, and steps mix chunks with
    other sequences' decode rows (each on its own kernel); the two rounds run the shared
    prefix cold, then as a prefix hit (chunked prefill over cached blocks read through the
    table) where the policy caches."""
    common = dict(policy=policy, block_size=block_size, max_num_batched_tokens=20)
    native = _engine(tiny, **common)
    triton = _engine(tiny, **common, attention_backend="triton")
    assert triton.allocator.block_size == native.allocator.block_size == (block_size or 128)
    for round_prompts in (PROMPTS[:4], PROMPTS[3:]):
        want = _tokens(native, round_prompts)
        assert _tokens(triton, round_prompts) == want
    if policy == "vllm":
        assert triton.stats().prefix_hit_tokens >= 32  # SYSTEM's 36 tokens, less a partial
    assert_no_leaks(triton)


def test_a_mixed_step_runs_its_decode_rows_on_the_decode_kernel(tiny):
    """One step holding a prefill chunk and two decode rows: the decode kernel runs over the
    two (by their rows), the prefill kernel over the chunk's tiles only."""
    plan_meta = AttentionMetadata(
        torch.arange(9, dtype=torch.int64) + 16,
        torch.tensor([[1, 2], [3, 0], [4, 0]], dtype=torch.int32),
        torch.tensor([20, 5, 9], dtype=torch.int32),
        torch.tensor([0, 7, 8, 9], dtype=torch.int32),  # 7 new tokens, then 1 and 1
    )
    kernels = _engine(tiny, attention_backend="triton").parts.runner.backend.kernels
    plan = TritonPlan(plan_meta, 16, 2, torch.device("cpu"), kernels)
    assert plan.tiles.tolist() == [[0, 0]] and plan.num_decode == 2
    assert plan.decode_rows.tolist() == [7, 8] and plan.decode_lens.tolist() == [5, 9]
    assert plan.decode_tables.tolist() == [[3, 0], [4, 0]]


def test_forked_samples_copy_their_shared_block_on_the_triton_kernel(tiny):
    # n = 2 forks after the prompt: the partial last block is shared, then copied on write.
    native = _engine(tiny, block_size=16)
    triton = _engine(tiny, block_size=16, attention_backend="triton")
    want = _tokens(native, [SYSTEM + [1, 2]], n=2)
    assert _tokens(triton, [SYSTEM + [1, 2]], n=2) == want
    assert_no_leaks(triton)


def test_the_start_up_report_names_the_backend_and_keeps_any_block_size(tiny):
    engine = _engine(tiny, block_size=12, attention_backend="triton", device="cpu")
    report = engine.parts.startup_report
    assert "block_size=12 tokens (backend triton)" in report  # the tile is not the page
    assert "device cpu, float32, attention triton (Triton's interpreter" in report
    assert engine.allocator.block_size == 12
    native = _engine(tiny, block_size=12)
    assert "attention native" in native.parts.startup_report
    assert native.allocator.block_size == 12


class _Replayed:
    """A CPU stand-in for ``torch.cuda.CUDAGraph``: ``record`` runs the function once and keeps
    it; ``replay`` runs it again into the recorded output, as a graph replay rewrites it."""

    def record(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self):
        with torch.inference_mode():  # the recorded output is the forward's inference tensor
            self.out.copy_(self.fn())


def test_decode_graph_replays_equal_the_eager_step_and_padding_writes_nothing(tiny):
    engine = _engine(tiny, block_size=16, attention_backend="triton", max_num_seqs=6)
    runner = engine.parts.runner
    line = runner.capture_graphs(6, 128, graph_factory=_Replayed)
    assert line.endswith("batch sizes 1,2,4,6")
    graphs = runner.graphs
    # Three sequences of 5, 17 and 30 tokens already cached in shuffled blocks.
    tables = torch.tensor([[9, 0], [3, 12], [20, 7]], dtype=torch.int32)
    ctx = torch.tensor([6, 18, 31], dtype=torch.int32)
    pos = (ctx - 1).to(torch.int64)
    slots = tables[torch.arange(3), pos // 16].to(torch.int64) * 16 + pos % 16
    meta = AttentionMetadata(slots, tables, ctx, torch.arange(4, dtype=torch.int32))
    ids = torch.tensor([11, 22, 33])
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    replayed = graphs.run(ids, pos, meta)  # bucket 4: one padding row
    assert graphs.replays == 1 and replayed.shape == (3, tiny[0].vocab_size)
    after_replay = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k0, v0), (k1, v1) in zip(before, after_replay, strict=True):
        k0.view(-1, *k0.shape[2:])[slots] = k1.view(-1, *k1.shape[2:])[slots]
        v0.view(-1, *v0.shape[2:])[slots] = v1.view(-1, *v1.shape[2:])[slots]
        assert torch.equal(k0, k1) and torch.equal(v0, v1)  # only the 3 real slots changed
    # The eager steps on the same pool state (their K/V writes are the same values again): on
    # the Triton kernels, and on the native C path.
    plan = TritonPlan(meta, 16, tiny[0].num_kv_heads, torch.device("cpu"), runner.backend.kernels)
    eager = runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta, 16, plan))
    torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-6)
    hidden = runner.model(ids, pos, runner.kv_caches, meta, 16, None)
    torch.testing.assert_close(replayed, runner.model.compute_logits(hidden), rtol=0, atol=1e-5)
    assert graphs.run(torch.tensor([1, 2]), torch.tensor([3, 4]), AttentionMetadata(
        torch.tensor([1, 2]), tables[:1], torch.tensor([5], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
    )) is None  # a prefill chunk is no graph's step  # fmt: skip


class OwnOps(TritonPlan):
    """The layer's own torch ops (``LayerOps``), RoPE by torch and the K/V store by
    ``write_kv``, attention on the same Triton kernels."""

    norm, add_norm, silu_mul = LayerOps.norm, LayerOps.add_norm, LayerOps.silu_mul

    def rope_attend(self, qkv, cos, sin, kv_cache, heads, scale):
        q, k, v = rotated_qkv(qkv, cos, sin, heads)
        self.kernels.write_kv(k, v, *kv_cache, self.slot_mapping)
        return self.attend_stored(q, kv_cache, scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_layer_equals_the_layers_own_ops(tiny_long_model, dtype, monkeypatch):
    """``TritonPlan``'s ops (RoPE + the K/V store in one kernel; in bf16 also RMSNorm,
    add + RMSNorm and SiLU * up in one each) against the layer's torch ops with the K/V written
    by ``write_kv`` and the same attention: the same hidden states and pool in fp32 (bit for
    bit), within bf16 rounding in bf16."""
    from pagedkv.model import load_model
    from tests.model.triton.fused_support import round_bf16_to_nearest_even

    round_bf16_to_nearest_even(monkeypatch)  # the interpreter truncates; a GPU rounds
    config, model, _ = load_model(tiny_long_model, dtype, progress=False)
    kernels = _engine((config, model, None), attention_backend="triton",
                      dtype=dtype).parts.runner.backend.kernels  # fmt: skip
    page_tokens = [5, 23]  # two sequences: a prompt of 5, one of 23 in two chunks
    tables = torch.tensor([[3, 0], [1, 6]], dtype=torch.int32)
    ctx = torch.tensor(page_tokens, dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in page_tokens])
    slots = torch.cat([tables[i, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16
                       for i, n in enumerate(page_tokens)])  # fmt: skip
    meta = AttentionMetadata(slots, tables, ctx, torch.tensor([0, 5, 28], dtype=torch.int32))
    ids = torch.randint(0, config.vocab_size, (28,), generator=torch.Generator().manual_seed(1))

    def forward(fused: bool):
        from pagedkv.model.kv_pool import allocate_kv_caches
        from tests.model.helpers import page_of

        kv = allocate_kv_caches(page_of(config, 16, model.dtype), 8)
        kind = TritonPlan if fused else OwnOps
        plan = kind(meta, 16, config.num_kv_heads, torch.device("cpu"), kernels)
        return model(ids, pos, kv, meta, 16, plan), kv

    (fused, kv_fused), (own, kv_own) = forward(True), forward(False)
    if dtype == "float32":
        assert torch.equal(fused, own)
    else:
        torch.testing.assert_close(fused.float(), own.float(), rtol=3e-2, atol=3e-2)
    # RoPE + store is bit-equal: every layer's pool in fp32; in bf16 the first layer's (its
    # input norm's bf16 outputs equal torch's here; later layers' inputs differ by SiLU's ulps).
    layers = len(kv_own) if dtype == "float32" else 1
    for (k1, v1), (k2, v2) in list(zip(kv_fused, kv_own, strict=True))[:layers]:
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_partial_prefix_hits_copy_their_slots_on_the_triton_kernel(tiny):
    """``--prefix-match-unit 1``: the second prompt's hit ends 3 tokens into SYSTEM's third
    block, still held by the first (running), so those 3 slots of every layer are copied by
    the block-copy kernel; the tokens equal the native path's without a prefix cache."""
    first, second = SYSTEM + list(range(80, 92)), SYSTEM[:35] + [5, 6, 7]
    native = _engine(tiny, policy="paged-nocache:16")
    want = _tokens(native, [first]) + _tokens(native, [second])
    triton = _engine(tiny, block_size=16, prefix_match_unit=1, attention_backend="triton")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    triton.add_request(first, params, request_id="first")
    triton.step()
    outs = {o.request_id: o for o in triton.generate([second], params)}
    while triton.has_unfinished():
        outs.update((o.request_id, o) for o in triton.step())
    (other,) = set(outs) - {"first"}
    got = [[c.token_ids for c in outs[k].outputs] for k in ("first", other)]
    assert got == want
    assert triton.stats().prefix_copy_bytes > 0
    assert_no_leaks(triton)
