"""The host swap pool on its own (one step's copies move once), the swap settings at the edge
(EngineConfig fields, the shared --preemption-mode / --swap-space flags), and the scheduler's
limits, whose defaults and rules EngineConfig and the flags take from SchedulerConfig."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedkv.commands.engine_flags import add_engine_args, engine_config
from pagedkv.engine import EngineConfig
from pagedkv.engine.kv.swap_pool import HostSwapPool
from pagedkv.errors import UsageError
from pagedkv.kvcache import PagedAllocator
from pagedkv.model.kv_pool import allocate_kv_caches
from pagedkv.pages.page_format import PageFormat
from pagedkv.sched import Scheduler, SchedulerConfig
from pagedkv.sched.batch import ScheduledBatch


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(preemption_mode="swap"), "needs a --swap-space"),
        (dict(preemption_mode="swap", swap_space_bytes=0), "needs a --swap-space"),
        (dict(preemption_mode="swap", swap_space_bytes=-1), "integer >= 0"),
        (dict(swap_space_bytes=1 << 20), "only used with --preemption-mode swap"),
        (dict(preemption_mode="spill"), "preemption_mode must be one of"),
    ],
)
def test_bad_swap_config_is_a_usage_error(fields, match):
    with pytest.raises(UsageError, match=match):
        EngineConfig(**fields)


def test_engine_flags_build_the_swap_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    config = engine_config(p.parse_args(["--preemption-mode", "swap", "--swap-space", "64MiB"]))
    assert (config.preemption_mode, config.swap_space_bytes) == ("swap", 64 << 20)
    default = engine_config(p.parse_args(["--preemption-mode", "swap"]))
    assert default.swap_space_bytes == 4 << 30  # vLLM's default, as the simulator's
    assert engine_config(p.parse_args([])).preemption_mode == "recompute"
    with pytest.raises(UsageError):
        engine_config(p.parse_args(["--swap-space", "1GiB"]))  # without swap mode


SCHEDULING = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "preemption",
    "preemption_mode",
)


def test_the_engine_and_its_flags_take_the_schedulers_defaults():
    sched, engine = SchedulerConfig(), EngineConfig()
    assert [getattr(engine, f) for f in SCHEDULING] == [getattr(sched, f) for f in SCHEDULING]
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (64, 2048)  # the engine's
    bare = Scheduler(PagedAllocator(9, 4))
    assert (bare.max_num_seqs, bare.max_num_batched_tokens) == (64, 2048)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    flags = engine_config(p.parse_args([]))
    assert [getattr(flags, f) for f in SCHEDULING] == [getattr(sched, f) for f in SCHEDULING]
    help_text = " ".join(p.format_help().split())
    assert "running sequences at most (64)" in help_text
    assert "longer prompts run in chunks (2048)" in help_text


@pytest.mark.parametrize(
    "fields",
    [
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=True),
        dict(max_model_len=1),
        dict(preemption="random"),
        dict(preemption_mode="spill"),
    ],
)
def test_a_bad_limit_gets_the_schedulers_error_at_the_engines_edge(fields):
    with pytest.raises(UsageError) as at_engine:
        EngineConfig(**fields)
    with pytest.raises(UsageError) as at_scheduler:
        SchedulerConfig(**fields)
    assert str(at_engine.value) == str(at_scheduler.value)
    assert at_engine.value.param == at_scheduler.value.param == next(iter(fields))


def test_apply_moves_a_steps_blocks_once():
    page = PageFormat.mha(2, 2, 8, "fp32", block_size=4)
    device = allocate_kv_caches(page, 6)
    for k, v in device:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    pool = HostSwapPool(page, 3)
    out = ScheduledBatch(step=1, seqs=(), swap_out=((2, 0), (4, 1)))
    pool.apply(out, device)
    saved = [(k[[2, 4]].clone(), v[[2, 4]].clone()) for k, v in device]
    back = ScheduledBatch(step=2, seqs=(), swap_in=((1, 0), (0, 5)))
    pool.apply(back, device)
    for k, _ in device:
        k[0].zero_()  # written by the step's forward pass after the swap-in
    pool.apply(back, device)  # the same step again (a containment re-run): nothing moves
    pool.apply(ScheduledBatch(step=2, seqs=()), device)
    for (k, v), (k_saved, v_saved) in zip(device, saved, strict=True):
        assert torch.equal(k[5], k_saved[0]) and torch.equal(v[0], v_saved[1])
        assert not k[0].any()
    assert (pool.blocks_out, pool.blocks_in) == (2, 2)
    assert pool.bytes_in == 2 * pool.block_bytes == 2 * (2 * 2 * 4 * 2 * 8 * 4)
