"""`sim.scenario`: one library call is one `pagedkv simulate` run."""

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
