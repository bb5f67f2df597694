"""``simulate --tensor-parallel-size``: each rank holds its KV heads of every token (the
engine's head split, replicated heads on every rank that holds them), and both fitted clocks
put two all-reduces a layer on the step (pagedkv's own clock: no CUDA graphs at TP > 1)."""

from __future__ import annotations

import pytest

from pagedkv.errors import UsageError
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.scenario_load import load_scenario
from pagedkv.sim.simulate_config import SimulateConfig
from pagedkv.sim.vllm_class import clock as gc

BASE = dict(synthetic="requests=20,prompt=200-400,output=20-40,rate=inf", max_model_len=2048)


def test_replicated_kv_heads_take_room_on_every_rank():
    # Llama-3-8B: 8 KV heads. At TP 8 each GPU holds one; at TP 16 each head sits on 2 GPUs,
    # so the replica's tokens are half of what 16 GPUs of split heads would hold.
    tp16 = load_scenario(SimulateConfig(**BASE, model="llama-3-8b", tensor_parallel=16))
    record = tp16.model.kv_record_bytes  # the whole model's, all 8 heads
    assert tp16.pools_slots[0] == pytest.approx(tp16.pools_bytes[0] / record / 2, rel=1e-3)
    tp8 = load_scenario(SimulateConfig(**BASE, model="llama-3-8b", tensor_parallel=8))
    assert tp8.pools_slots[0] == pytest.approx(tp8.pools_bytes[0] / record, rel=1e-3)


def test_a_size_the_heads_refuse_is_one_line():
    with pytest.raises(UsageError, match="--tensor-parallel-size 3 does not divide") as err:
        load_scenario(SimulateConfig(**BASE, model="llama-3-8b", tensor_parallel=3))
    assert "\n" not in str(err.value)


def test_pagedkv_clock_prices_a_rank_and_its_all_reduces():
    pagedkv = dict(BASE, gpu="H200-141GB", clock="pagedkv-triton", policies=("vllm",))
    one = load_scenario(SimulateConfig(**pagedkv))
    two = load_scenario(SimulateConfig(**pagedkv, tensor_parallel=2))
    assert "TP 2" in two.clock() and "eager" in two.clock()
    cost1, cost2 = (s.cost_for(s.policies[0]) for s in (one, two))
    decode = StepShape.of([(1000, 1)] * 64, 16)  # 64 decode rows of 1000-token contexts
    assert cost1.graphed(decode) and not cost2.graphed(decode)
    md = two.model
    reduces = md.num_layers * 2 * gc.all_reduce_s(two.gpu, gc.ACT_BYTES * 64 * md.hidden_size, 2)
    assert reduces > 0
    # A rank computes half of every projection and head, plus the all-reduces.
    assert reduces < cost2.gpu_s(decode) < cost1.gpu_s(decode) + reduces
