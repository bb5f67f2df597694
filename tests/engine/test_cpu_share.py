"""Fewer threads while other processes hold cores (``pagedkv/cpu_share.py``): the count from
hand-computed windows, a real CPU-burning process seen as one, and the engine's tokens and
logprobs bit-identical whether its steps ran on 1 thread or 2."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from pagedkv.cpu_share import CpuShare, Sample, busy_seconds, free_threads, read_sample
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model.native.projection import sharded_product
from pagedkv.model.projection import keep_shards

from .conftest import assert_no_leaks


def test_free_threads_counts_the_cores_others_kept_busy():
    start = Sample(machine_busy_s=100.0, own_s=10.0, wall_s=50.0)

    def after(busy: float, own: float, wall: float = 1.0) -> Sample:
        return Sample(100.0 + busy, 10.0 + own, 50.0 + wall)

    # 2 cores, our 2 threads beside a burner: 3 runnable on 2 cores, each about 2/3 of one.
    assert free_threads(start, after(busy=2.0, own=1.33), cores=2, ceiling=2) == 1
    # Quiet: every busy second was ours (spinning included).
    assert free_threads(start, after(busy=1.9, own=1.9), cores=2, ceiling=2) == 2
    # Our 1 thread beside the burner: the burner keeps its core.
    assert free_threads(start, after(busy=2.0, own=1.0), cores=2, ceiling=2) == 1
    # 8 cores, others busy on 2.6 of them over a 2 s window: 5.4 left -> 5, within the ceiling.
    assert free_threads(start, after(busy=9.0, own=3.8, wall=2.0), cores=8, ceiling=8) == 5
    assert free_threads(start, after(busy=9.0, own=3.8, wall=2.0), cores=8, ceiling=4) == 4
    # Never below one; clock skew (own time above the machine's) is nobody else's work.
    assert free_threads(start, after(busy=4.0, own=0.0), cores=2, ceiling=2) == 1
    assert free_threads(start, after(busy=1.0, own=1.2), cores=2, ceiling=2) == 2
    assert free_threads(start, start, cores=2, ceiling=2) == 2  # no time passed


PROC_STAT = b"""cpu  900 10 300 5000 20 5 5 7 0 0
cpu0 400 0 100 2000 10 2 3 5 0 0
cpu1 300 10 100 2500 5 1 1 2 0 0
cpu2 200 0 100 500 5 2 1 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_busy_seconds_sums_the_cores_this_process_may_use():
    # user + nice + system + irq + softirq of cpu0 and cpu2, at 100 ticks a second.
    assert busy_seconds(PROC_STAT, {0, 2}, 100) == pytest.approx((505 + 303) / 100)
    assert busy_seconds(PROC_STAT, {1}, 100) == pytest.approx(4.12)
    assert busy_seconds(PROC_STAT, {7}, 100) is None  # no line of its cores
    assert busy_seconds(b"garbage\ncpu0 x y\n", {0}, 100) is None


def test_cpu_share_answers_per_window_and_the_ceiling_without_proc_stat():
    samples = iter(
        [
            Sample(0.0, 0.0, 0.0),  # at construction
            Sample(0.5, 0.4, 0.1),  # 0.1 s in: shorter than the window, the ceiling still
            Sample(2.0, 1.0, 1.0),  # the window: others kept 1 of 2 cores busy
            Sample(2.2, 1.1, 1.1),  # inside the next window: the last answer
            Sample(4.0, 2.9, 2.0),  # quiet again: all of it ours
        ]
    )
    share = CpuShare(ceiling=2, cores=2, window_s=0.5, sample=lambda: next(samples))
    assert [share.threads() for _ in range(4)] == [2, 1, 1, 2]
    assert CpuShare(ceiling=3, cores=4, sample=lambda: None).threads() == 3
    with pytest.raises(ValueError, match="ceiling"):
        CpuShare(ceiling=0, cores=2)


@pytest.mark.skipif(read_sample() is None, reason="needs /proc/stat")
def test_a_real_burner_leaves_one_thread_of_two():
    """A process spinning the whole window holds one core, whatever else the machine runs:
    at most one of two cores is left (so this holds on a busy machine too)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the burner started
        share = CpuShare(ceiling=2, cores=2, window_s=0.5)
        time.sleep(0.6)
        assert share.threads() == 1
    finally:
        burner.kill()
        burner.wait()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
    keep_shards(1)


def test_kept_shards_give_the_two_thread_product_on_one_thread(two_threads):
    """A prompt's product (more rows than the native kernel takes) as 2 column shards on 1
    thread: the bits of the 2-thread product."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(200, 576, generator=gen), torch.randn(960, 576, generator=gen)
    both = sharded_product(x, w, None)
    torch.set_num_threads(1)
    assert sharded_product(x, w, None) is None  # alone, one thread is one mm
    keep_shards(2)
    assert torch.equal(sharded_product(x, w, None), both)


class OneThread:
    """A ``CpuShare`` that always finds one core left."""

    def threads(self) -> int:
        return 1


def _run(embedded, prompts, governed: bool):
    config = EngineConfig(log_startup=False, max_model_len=512, adapt_threads=governed)
    engine = LLMEngine(config, parts=build_parts(config, embedded))
    seen: list[int] = []
    hook = engine.runner.model.register_forward_pre_hook(
        lambda *_: seen.append(torch.get_num_threads())
    )
    if governed:
        assert engine.runner.cpu_share is not None  # 2 threads at start-up: adaptive
        engine.runner.cpu_share = OneThread()
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    outs = engine.generate(prompts, params)
    hook.remove()
    assert torch.get_num_threads() == 2  # restored after every step
    assert_no_leaks(engine)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], set(seen)


def test_the_engine_computes_the_same_bits_on_fewer_threads(embedded, two_threads):
    """A 230-token prompt (MKL's sharded GEMM) and a short one (the native kernels), run by
    an engine whose every step the share cut to 1 thread, against one fixed at 2."""
    tok = embedded[2]
    prompts = [tok.decode(tok.encode("The history of the lighthouse. " * 40)[:230]), "Hello"]
    fixed, fixed_threads = _run(embedded, prompts, governed=False)
    governed, governed_threads = _run(embedded, prompts, governed=True)
    assert (fixed_threads, governed_threads) == ({2}, {1})
    assert governed == fixed
