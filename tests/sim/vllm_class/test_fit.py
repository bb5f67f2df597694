"""Fitting a GPU clock: on data made from known parameters the fit recovers them; the clock
file round-trips and refuses what is not one (sim/vllm_class/fit.py, sim/clock_presets.py)."""

from __future__ import annotations

import json
import math

import pytest

from pagedkv.errors import UsageError
from pagedkv.sim.clock_presets import clock_for, shipped
from pagedkv.sim.gpus import GPUS, get_gpu
from pagedkv.sim.vllm_class.clock import ELEMENTWISE_OPS, GPUClock, KernelPrice
from pagedkv.sim.vllm_class.data import OpRow, price
from pagedkv.sim.vllm_class.fit import fit_clock, get_param, read_clock, with_params, write_clock

pytest.importorskip("scipy")

GPU = get_gpu("A100-80GB")
TRUE = GPUClock(
    gemm_launch_s=4e-6, gemm_bw_eff=0.85, gemm_flops_eff=0.7, gemm_knee=1.8,
    elementwise={op: KernelPrice(2e-6 + i * 5e-7, 0.3 + 0.1 * i)
                 for i, op in enumerate(ELEMENTWISE_OPS)},
    decode_launch_s=5e-6, decode_split_s=6e-6, decode_bw_eff=0.75, decode_tile_eff=0.6,
    decode_per_seq_s=5e-8, prefill_launch_s=12e-6, prefill_split_s=3e-6, prefill_tile_eff=0.35,
    step_base_s=1.2e-3, step_per_seq_s=4e-5, step_per_worker_s=3e-4,
)  # fmt: skip


def _rows(clock: GPUClock, noise: float = 0.0) -> list[OpRow]:
    rows = []

    def add(family, op, dims):
        row = OpRow(family, op, "a100", "m", 1, dims, 1.0, "made/here.csv")
        t = price(row, clock, GPU)
        # deterministic +-noise, uncorrelated with the shape
        wiggle = 1 + noise * math.sin(1e3 * (len(rows) + 1) ** 1.5)
        rows.append(OpRow(family, op, "a100", "m", 1, dims, t * wiggle, "made/here.csv"))

    for m in (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192):
        for k, n in ((4096, 4096), (4096, 12288), (11008, 4096), (1024, 1024)):
            add("gemm", "mlp_up_proj", (m, k, n))
    for op in ELEMENTWISE_OPS:
        for num_bytes in (1e3, 1e5, 1e6, 1e7, 3e7, 1e8, 1e9):
            add("elementwise", op, (int(num_bytes),))
    for batch in (1, 2, 4, 8, 16, 24, 32, 64, 128, 256):
        for ctx in (33, 129, 513, 1025, 2049):
            add("decode_attention", "attn_decode", (batch, ctx, 4, 128))
    for chunk in (64, 128, 256, 512, 1024, 2048):
        for cached in (0, 256, 1024, 2048):
            add("prefill_attention", "attn_prefill", (chunk, cached, 32, 128))
    for seqs in (8, 16, 32, 64, 128):
        for tp in (1, 2, 4):
            add("step_overhead", "cpu", (seqs, tp))
    return rows


NAMES = [
    "gemm_launch_s", "gemm_bw_eff", "gemm_flops_eff", "gemm_knee", "decode_launch_s",
    "decode_split_s", "decode_bw_eff", "decode_tile_eff", "prefill_launch_s", "prefill_split_s",
    "prefill_tile_eff", "step_base_s", "step_per_seq_s", "step_per_worker_s",
    *(f"elementwise:{op}:{a}" for op in ELEMENTWISE_OPS for a in ("launch_s", "bw_eff")),
]  # fmt: skip


def test_the_fit_recovers_known_parameters_from_exact_data() -> None:
    clock, sigmas = fit_clock(_rows(TRUE), GPU)  # starts from GPUClock()'s defaults
    for name in NAMES:
        assert get_param(clock, name) == pytest.approx(get_param(TRUE, name), rel=0.02), name
        assert sigmas[name] < 0.05, name


def test_noise_of_three_percent_moves_the_gemm_rates_by_less_than_two() -> None:
    clock, _ = fit_clock([r for r in _rows(TRUE, noise=0.03) if r.family == "gemm"], GPU)
    for name in ("gemm_bw_eff", "gemm_flops_eff"):
        assert get_param(clock, name) == pytest.approx(get_param(TRUE, name), rel=0.02)


def test_a_family_without_rows_keeps_the_base_clocks_numbers() -> None:
    gemm_only = [r for r in _rows(TRUE) if r.family == "gemm"]
    base = GPUClock(decode_bw_eff=0.123)
    clock, sigmas = fit_clock(gemm_only, GPU, base)
    assert clock.decode_bw_eff == 0.123 and "decode_bw_eff" not in sigmas
    assert clock.gemm_bw_eff == pytest.approx(0.85, rel=0.02)


def test_with_params_replaces_only_what_it_names() -> None:
    moved = with_params(TRUE, {"gemm_knee": 3.0, "elementwise:add:bw_eff": 0.9})
    assert moved.gemm_knee == 3.0 and moved.elementwise["add"].bw_eff == 0.9
    assert moved.elementwise["emb"] == TRUE.elementwise["emb"]
    assert moved.decode_tile_eff == TRUE.decode_tile_eff


def test_a_clock_file_round_trips(tmp_path) -> None:
    path = tmp_path / "clock.json"
    write_clock(path, TRUE, GPU, {"fitted_on": ["made/here.csv"]})
    clock, meta = read_clock(path)
    assert clock == TRUE and meta["gpu"] == "A100-80GB"
    assert clock_for(GPUS["L4"], str(path))[0] == TRUE  # --clock FILE wins over presets


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("{", "cannot read GPU clock"),
        ('{"format": "x"}', "not a pagedkv GPU clock"),
        ('{"format": "pagedkv-gpu-clock", "version": 9}', "version 9 is not supported"),
        ('{"format": "pagedkv-gpu-clock", "version": 1, "params": {}}', "'params' must be"),
    ],
)
def test_a_bad_clock_file_is_one_usage_error(tmp_path, body, words) -> None:
    path = tmp_path / "c.json"
    path.write_text(body)
    with pytest.raises(UsageError, match=words):
        read_clock(path)


def test_a_negative_parameter_in_a_file_is_refused(tmp_path) -> None:
    path = tmp_path / "c.json"
    write_clock(path, TRUE, GPU, {})
    data = json.loads(path.read_text())
    data["params"]["gemm_bw_eff"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="bad clock parameters"):
        read_clock(path)


def test_every_gpu_preset_has_a_clock_and_says_whose() -> None:
    assert {"A100-80GB", "H100-80GB"} <= set(shipped())
    for name, gpu in GPUS.items():
        clock, source = clock_for(gpu)
        assert isinstance(clock, GPUClock)
        assert ("borrowed" in source) == (name not in shipped()), source
    # the H100 file has no attention rows of its own: it says it kept the A100's numbers
    meta = read_clock(
        __import__("pathlib").Path(__import__("pagedkv").__file__).parent
        / "presets/clocks/H100-80GB.json"
    )[1]
    assert {"decode_attention", "prefill_attention", "step_overhead"} <= set(meta["borrowed"])
