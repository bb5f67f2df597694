"""The parts of ``bench_mla.py``: the DeepSeek-V2-Lite-shaped model with random weights, a
decode step over contexts already in the paged latent pool, pagedkv's native MHA kernel on a
cache of the same bytes (the read rate MLA's op is held against), and the engine's start-up
pool sizing for two presets on one pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import allocate_kv_caches
from pagedkv.model.llama import build_model
from pagedkv.model.weights import canonical_names
from pagedkv.pages.layout import layout_from_shape
from pagedkv.pages.page_format import PageFormat
from pagedkv.pages.sources import load_preset_config, shape_from_hf_config

BLOCK_SIZE = 16
VOCAB = 32000  # the benchmark's: attention does not read the vocabulary


def mla_model(num_layers: int):
    """DeepSeek-V2-Lite's shape with ``num_layers`` layers (the first dense) and a smaller
    vocabulary, random fp32 weights loaded as the engine loads a checkpoint."""
    preset = {**load_preset_config("deepseek-v2-lite"), "num_hidden_layers": num_layers,
              "vocab_size": VOCAB, "torch_dtype": "float32"}  # fmt: skip
    config = ModelConfig.from_shape(shape_from_hf_config(preset, "deepseek-v2-lite-bench"))
    gen = torch.Generator().manual_seed(0)
    weights = {name: _random(config, name, gen) for name in sorted(canonical_names(config))}
    model = build_model(config)
    model.load_weights(weights, torch.float32)
    return model


def _random(config: ModelConfig, name: str, gen: torch.Generator) -> torch.Tensor:
    """A random tensor of canonical ``name``'s shape (scaled so activations stay O(1))."""
    shape = _shape(config, name.split(".", 2)[-1] if name.startswith("layers.") else name)
    if len(shape) == 1:
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


def _shape(config: ModelConfig, piece: str) -> tuple[int, ...]:
    d, moe, hidden = config.mla, config.moe, config.hidden_size
    if piece.startswith("experts."):
        piece = piece.split(".", 2)[2]
        return (hidden, moe.expert_intermediate_size) if "down" in piece else (
            moe.expert_intermediate_size, hidden)  # fmt: skip
    shared = moe.expert_intermediate_size * moe.num_shared_experts
    shapes = {
        "embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (VOCAB, hidden),
        "norm.weight": (hidden,), "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "q_proj.weight": (d.num_heads * d.qk_head_dim, hidden),
        "kv_a_proj.weight": (d.record_width, hidden), "kv_a_norm.weight": (d.kv_lora_rank,),
        "kv_b_proj.weight": (d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank),
        "o_proj.weight": (hidden, d.num_heads * d.v_head_dim),
        "gate_proj.weight": (config.intermediate_size, hidden),
        "up_proj.weight": (config.intermediate_size, hidden),
        "down_proj.weight": (hidden, config.intermediate_size),
        "router.weight": (moe.num_experts, hidden),
        "shared_experts.gate_proj.weight": (shared, hidden),
        "shared_experts.up_proj.weight": (shared, hidden),
        "shared_experts.down_proj.weight": (hidden, shared),
    }  # fmt: skip
    return shapes[piece]


@dataclass
class StepInputs:
    ids: torch.Tensor
    positions: torch.Tensor
    kv: list
    meta: AttentionMetadata
    block_size: int
    layer0_q: torch.Tensor  # a decode step's queries and records of layer 0, for the op alone
    layer0_records: torch.Tensor
    latent: object
    scale: float


def step_inputs(model, batch: int, context: int) -> StepInputs:
    """A decode step of ``batch`` sequences whose ``context - 1`` tokens are in the pool
    (random latent records, blocks shuffled) and whose last is this step's."""
    config, gen = model.config, torch.Generator().manual_seed(1)
    layout = layout_from_shape(config.model_shape(), "float32")
    blocks = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks + 1
    kv = allocate_kv_caches(PageFormat.from_layout(layout, BLOCK_SIZE), num_blocks)
    for (pool,) in kv:
        pool.normal_(generator=gen)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = order[: batch * blocks].view(batch, blocks).to(torch.int32)
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + last % BLOCK_SIZE
    meta = AttentionMetadata(slots, tables, torch.full((batch,), context, dtype=torch.int32),
                             torch.arange(batch + 1, dtype=torch.int32))  # fmt: skip
    mla = model.layers[0].mla
    dims = mla.dims
    q = torch.randn(batch, dims.num_heads, dims.qk_head_dim, generator=gen)
    records = torch.randn(batch, dims.record_width, generator=gen)
    ids = torch.randint(0, VOCAB, (batch,), generator=gen)
    positions = torch.full((batch,), last, dtype=torch.int64)
    return StepInputs(ids, positions, kv, meta, BLOCK_SIZE, q, records, mla.latent_weights(),
                      mla.scale)  # fmt: skip


def mha_same_bytes(batch: int, latent_bytes: int):
    """pagedkv's native MHA decode kernel (``pk_paged_attention``) over a GQA cache (32 query
    and 8 KV heads of 128, fp32) holding ``latent_bytes`` over ``batch`` sequences: the call,
    the bytes it reads and its context."""
    from pagedkv.model import native
    from pagedkv.model.attention import AttentionPlan, paged_attention

    hq, hkv, dim = 32, 8, 128
    context = max(1, latent_bytes // (batch * 2 * hkv * dim * 4))
    blocks = -(-context // BLOCK_SIZE)
    shape = (batch * blocks + 1, BLOCK_SIZE, hkv, dim)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    tables = torch.arange(1, batch * blocks + 1, dtype=torch.int32).view(batch, blocks)
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + last % BLOCK_SIZE
    meta = AttentionMetadata(slots, tables, torch.full((batch,), context, dtype=torch.int32),
                             torch.arange(batch + 1, dtype=torch.int32))  # fmt: skip
    plan = AttentionPlan(meta, BLOCK_SIZE, torch.float32, native.kernels())
    q, k, v = (
        torch.randn(batch, hq, dim),
        torch.randn(batch, hkv, dim),
        torch.randn(batch, hkv, dim),
    )

    def call():
        paged_attention(q, k, v, (k_cache, v_cache), plan, dim**-0.5)

    return call, batch * context * 2 * hkv * dim * 4, context


def capacity(pool: str) -> dict:
    """The engine's start-up section 1 (``plan_pool``) for the DeepSeek-V2-Lite and Llama-3-8B
    presets on one ``--kv-cache-memory`` pool in bf16: usable blocks x block size."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.pool_plan import plan_pool
    from pagedkv.units import parse_bytes

    memory = parse_bytes("--kv-cache-memory", pool)
    config = EngineConfig(kv_cache_memory_bytes=memory, dtype="bfloat16", device="cpu",
                          log_startup=False)  # fmt: skip
    models = {}
    for preset, family in (("deepseek-v2-lite", "deepseek_v2"), ("llama-3-8b", "llama")):
        shape = shape_from_hf_config({"model_type": family, **load_preset_config(preset)}, preset)
        plan = plan_pool(config, ModelConfig.from_shape(shape))
        usable = plan.num_blocks - 1  # the null block pads block tables
        models[preset] = {"record_bytes": plan.page_format.record_bytes,
                          "block_size": plan.page_format.block_size, "usable_blocks": usable,
                          "tokens": usable * plan.page_format.block_size}  # fmt: skip
    first, second = models.values()
    return {"pool": pool, "models": models, "ratio": first["tokens"] / second["tokens"]}
