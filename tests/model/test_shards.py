"""A rank's share of each canonical weight (``model/shards.py``), checked against slices worked
out by hand on the tiny llama's shapes, and the weights digest that names a model at any split."""

from __future__ import annotations

import pytest
import torch

from pagedkv.errors import UsageError
from pagedkv.model.shards import RankShard, WeightsDigest
from tests.model.tiny import tiny_model_config

# The tiny llama: 4 query heads and 2 KV heads of 16, hidden 64, MLP 96, vocabulary 300.
CONFIG = tiny_model_config()


def _weight(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)


def test_column_parallel_rows_and_row_parallel_columns():
    shard = RankShard.of(CONFIG, 2, 1)  # rank 1 of 2: query heads 2-3, KV head 1, MLP rows 48-95
    q, k = _weight(64, 64), _weight(32, 64)
    assert torch.equal(shard.slice("layers.0.q_proj.weight", q), q[32:64])
    assert torch.equal(shard.slice("layers.0.k_proj.weight", k), k[16:32])
    assert torch.equal(
        shard.slice("layers.0.v_proj.bias", torch.arange(32.0)), torch.arange(16.0, 32)
    )
    o = _weight(64, 64)
    assert torch.equal(shard.slice("layers.1.o_proj.weight", o), o[:, 32:64])
    up, down = _weight(96, 64), _weight(64, 96)
    assert torch.equal(shard.slice("layers.0.up_proj.weight", up), up[48:96])
    assert torch.equal(shard.slice("layers.0.down_proj.weight", down), down[:, 48:96])
    norm = torch.ones(64)
    assert shard.slice("layers.0.input_layernorm.weight", norm) is norm


def test_vocab_rows_padded_on_the_last_rank():
    embed = _weight(300, 64)
    shards = [RankShard.of(CONFIG, 2, r) for r in (0, 1)]
    assert [s.vocab_rows for s in shards] == [150, 150]
    assert torch.equal(shards[1].slice("embed_tokens.weight", embed), embed[150:])
    odd = RankShard.of(CONFIG, 1, 0)
    assert odd.slice("lm_head.weight", embed).shape == (300, 64)
    # Vocabulary 300 over 8 ranks would be 38 rows each: the last holds 34 and 4 zero rows.
    config8 = tiny_model_config().__class__(
        **{
            **CONFIG.__dict__,
            "num_heads": 8,
            "num_kv_heads": 8,
            "head_dim": 8,
            "intermediate_size": 96,
        }
    )
    last = RankShard.of(config8, 8, 7).slice("embed_tokens.weight", embed)
    assert last.shape == (38, 64) and torch.equal(last[:34], embed[266:]) and not last[34:].any()


def test_a_ranks_model_shape():
    local = RankShard.of(CONFIG, 2, 0).local_config()
    assert (local.num_heads, local.num_kv_heads, local.head_dim) == (2, 1, 16)
    assert (local.intermediate_size, local.vocab_size, local.hidden_size) == (48, 150, 64)


def test_quantized_blocks_cut_in_two_are_refused():
    # MLP 96 at TP 2: 48 inputs a rank, not a whole number of 32-input blocks.
    with pytest.raises(UsageError, match="cut the quantized blocks of 32 in two"):
        RankShard.of(CONFIG, 2, 0, weights="int8")
    with pytest.raises(UsageError, match="does not divide the model's intermediate size 95"):
        RankShard.of(CONFIG.__class__(**{**CONFIG.__dict__, "intermediate_size": 95}), 2, 0)


def test_the_digest_names_the_weights_not_their_order_or_split():
    tensors = {"a": _weight(4, 4), "b": torch.ones(3)}
    first, second = WeightsDigest(torch.float32, "float"), WeightsDigest(torch.float32, "float")
    for name in ("a", "b"):
        first.update(name, tensors[name])
    for name in ("b", "a"):
        second.update(name, tensors[name])
    assert first.hexdigest() == second.hexdigest()
    quantized = WeightsDigest(torch.float32, "int8")
    changed = WeightsDigest(torch.float32, "float")
    for name, t in tensors.items():
        quantized.update(name, t)
        changed.update(name, t + 1)
    assert len({first.hexdigest(), quantized.hexdigest(), changed.hexdigest()}) == 3
