"""`sim.scenario_load`: one library call is one `pagedkv simulate` run."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from pagedkv.cli import main
from pagedkv.errors import UsageError
from pagedkv.sim import SimulateConfig, load_scenario, simulate

SPEC = "requests=10,prompt=100-400,output=3-20,system=200,turns=2,gap=1"


def test_the_library_call_gives_what_the_command_prints() -> None:
    config = SimulateConfig(
        synthetic=SPEC, max_model_len=2048, kv_memory_bytes=(2**30,), policies=("vllm", "sglang")
    )
    summaries = [s for _, s in simulate(config)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["simulate", "--synthetic", SPEC, "--max-model-len", "2k", "--kv-memory",
                     "1GiB", "--policy", "vllm,sglang", "--json"])  # fmt: skip
    assert code == 0
    printed = json.loads(out.getvalue())
    for a, b in zip(summaries, printed, strict=True):
        a, b = dict(a), dict(b)
        del a["wall_time_s"], b["wall_time_s"]
        assert a == b


def test_the_scenario_sizes_the_pool_and_describes_itself() -> None:
    scenario = load_scenario(SimulateConfig(synthetic=SPEC, max_model_len=2048))
    # A100-80GB: 80e9 x 0.9 - weights - 4 GiB of activations, in 128 KiB records (llama-3-8b)
    (pool,) = scenario.pools_bytes
    assert pool == int(80e9 * 0.9) - scenario.model.weight_bytes - 4 * 2**30
    assert scenario.pools_slots == (pool // 131072,)
    assert len(scenario.requests) == 20 and scenario.skipped == []
    assert "20 requests" in scenario.describe() and "A100-80GB" in scenario.describe()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rate_scale": float("nan")}, "rate_scale must be a finite number"),
        ({"step_overhead_s": float("inf")}, "step_overhead_s must be a finite number"),
        ({"sample_interval_s": 0.0}, "sample_interval_s must be > 0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"trace": "x.jsonl"}, "exactly one of --trace FILE or --synthetic SPEC"),
        ({"policies": ()}, "name at least one policy"),
        ({"gpu": "TPU"}, "unknown GPU 'TPU'"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"kv_memory_bytes": (100 * 2**10,), "policies": ("vllm",)},
         "a KV pool of 0 tokens holds fewer than 2 blocks of 16 tokens (vllm)"),
        ({"kv_memory_bytes": (2**20,), "policies": ("vllm",), "block_sizes": (4, 128)},
         "a KV pool of 8 tokens holds fewer than 2 blocks of 128 tokens (vllm@128)"),
    ],
)  # fmt: skip
def test_config_errors_are_usage_errors_naming_the_field(changes, message) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        load_scenario(SimulateConfig(**{"synthetic": SPEC, **changes}))


# -- the clock: kernel (default), roofline, a profile; swap preemption ------------------------

PAPER = dict(
    synthetic="workload=sharegpt,requests=60,rate=4",
    model="opt-13b",
    gpu="A100-40GB",
    kv_memory_bytes=(12 * 2**30,),
    max_model_len=2048,
)


def test_each_policy_gets_its_frameworks_kernel_unless_one_is_named() -> None:
    policies = ("vllm", "sglang", "trtllm", "reserved", "paged:8")
    scenario = load_scenario(SimulateConfig(**PAPER, policies=policies, cost="kernel"))
    kernels = [scenario.cost_for(p).backend for p in scenario.policies]
    assert kernels == ["flash-attn", "flashinfer", "trtllm-mha", "contiguous", "flash-attn"]
    named = load_scenario(SimulateConfig(**PAPER, policies=policies, kernel="fa4", cost="kernel"))
    # a named kernel prices every paged policy; the reserved baseline stays contiguous
    assert [named.cost_for(p).backend for p in named.policies] == ["fa4"] * 3 + [
        "contiguous",
        "fa4",
    ]
    roofline = load_scenario(SimulateConfig(**PAPER, cost="roofline"))
    assert all(roofline.cost_for(p) is roofline.cost for p in roofline.policies)
    assert (
        "kernel cost model (flash-attn, flashinfer, trtllm-mha, contiguous)" in scenario.describe()
    )


def test_the_kernel_clock_sees_the_block_size_and_the_roofline_does_not() -> None:
    def durations(cost: str) -> dict[int, float]:
        policies = ("paged-nocache:1", "paged-nocache:16")
        kernel = "vllm" if cost == "kernel" else None  # the paper's v0 PagedAttention
        runs = simulate(SimulateConfig(**PAPER, policies=policies, cost=cost, kernel=kernel))
        return {s["block_size"]: s["duration_s"] for _, s in runs}

    roofline, kernel = durations("roofline"), durations("kernel")
    # a roomy pool (no preemption either way): the roofline prices B=1 and B=16 alike
    assert roofline[1] == pytest.approx(roofline[16], rel=1e-9)
    # the vLLM kernel walks one block per token at B=1: 5.3x the bytes' time in attention
    assert kernel[1] > 1.2 * kernel[16]
    assert kernel[16] == pytest.approx(roofline[16], rel=0.05)  # above the saturating size


def test_swap_preemption_through_the_config_and_the_command(capsys) -> None:
    tight = {**PAPER, "kv_memory_bytes": (2 * 2**30,), "policies": ("paged-nocache:16",)}
    ((_, swap),) = simulate(SimulateConfig(**tight, preemption_mode="swap", swap_space_bytes=2**30))
    ((_, recompute),) = simulate(SimulateConfig(**tight))
    assert swap["swap_outs"] > 0 and swap["swap_time_s"] > 0
    assert recompute["swap_outs"] == 0 and recompute["recomputed_tokens"] > 0
    assert swap["num_finished"] == recompute["num_finished"] == 60
    argv = ["simulate", "--synthetic", PAPER["synthetic"], "--model", "opt-13b", "--gpu",
            "A100-40GB", "--kv-memory", "2GiB", "--max-model-len", "2048", "--policy",
            "paged-nocache:16", "--preemption-mode", "swap", "--host-link", "pcie5-x16", "--json"]  # fmt: skip
    assert main(argv) == 0
    (printed,) = json.loads(capsys.readouterr().out)
    # the same swaps; PCIe 5 moves the same blocks in less time than the A100's PCIe 4
    assert printed["swapped_blocks_out"] > 0
    assert (
        printed["swap_time_s"]
        < swap["swap_time_s"] * printed["swapped_blocks_out"] / swap["swapped_blocks_out"]
    )


def test_a_cost_profile_replaces_the_gpu_clock(tmp_path) -> None:
    from pagedkv.sched.step_shape import StepShape, TimedStep
    from pagedkv.sim.costs.profile_fit import build_profile

    shapes = [StepShape(n, 10 * n, 10 * n, n, n, n, 16) for n in range(1, 30)]
    samples = [TimedStep(s, 0.05) for s in shapes]  # every step 50 ms, whatever its shape
    path = tmp_path / "profile.json"
    build_profile(samples, {"model": "m", "machine": "here"}).write(path)
    ((run, summary),) = simulate(
        SimulateConfig(**PAPER, policies=("vllm",), cost_profile=str(path))
    )
    assert run.duration_s == pytest.approx(run.num_steps * 0.05, rel=1e-6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cost": "magic"}, "cost must be one of fitted, kernel, roofline"),
        ({"kernel": "cuda9"}, "unknown attention kernel 'cuda9'"),
        ({"kernel": "vllm", "cost": "roofline"}, "--kernel prices an attention kernel: drop --cost roofline"),
        ({"preemption_mode": "swap"}, "needs a --swap-space SIZE > 0"),
        ({"preemption_mode": "teleport"}, "unknown preemption_mode 'teleport'"),
        ({"preemption_mode": "swap", "swap_space_bytes": 2**30, "host_link": "usb2"},
         "unknown link 'usb2'"),
        ({"cost_profile": "/nonexistent/p.json"}, "cannot read cost profile"),
    ],
)  # fmt: skip
def test_clock_and_swap_errors_are_usage_errors(changes, message) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        load_scenario(SimulateConfig(**{**PAPER, **changes}))


def test_paper_workload_in_a_synthetic_spec_and_its_clashes() -> None:
    scenario = load_scenario(SimulateConfig(**PAPER))
    assert len(scenario.requests) == 60
    with pytest.raises(UsageError, match=re.escape("workload= sets the lengths; drop prompt=")):
        load_scenario(SimulateConfig(**{**PAPER, "synthetic": "workload=alpaca,prompt=5"}))


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--kernel", "cuda9"], "unknown attention kernel 'cuda9'"),
        (["--cost", "roofline", "--kernel", "vllm"], "--kernel prices an attention kernel: drop --cost roofline"),
        (["--preemption-mode", "swap", "--swap-space", "banana"], "--swap-space"),
        (["--preemption-mode", "swap", "--host-link", "usb2"], "unknown link 'usb2'"),
        (["--cost-profile", "/nonexistent/p.json"], "cannot read cost profile '/nonexistent/p.json'"),
    ],
)  # fmt: skip
def test_clock_and_swap_flags_fail_in_one_line(flags, words, capsys) -> None:
    argv = ["simulate", "--synthetic", "workload=alpaca,requests=5", "--max-model-len", "2k"]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
