"""The fitted step cost: the fit recovers known coefficients, stays non-negative, leaves
disturbed steps out; a profile file round-trips, drives the simulator, and every bad file is one
UsageError naming it."""

from __future__ import annotations

import json
import random

import pytest

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sched.step_shape import StepShape, TimedStep
from pagedkv.sim.costs.profile_fit import build_profile, fit_cost, fit_robust
from pagedkv.sim.costs.profiled import FEATURES, ProfiledCostModel, load_cost_profile
from pagedkv.sim.simulator import Simulation
from pagedkv.traces import FreshSegments, TraceRequest

# Known costs (seconds per unit), chosen by hand, of the order a CPU engine shows.
TRUE = {
    "per_step_s": 0.03,
    "per_batched_token_s": 0.002,
    "per_seq_s": 0.004,
    "per_kv_read_token_s": 2e-5,
    "per_attention_pair_s": 1e-7,
    "per_kv_block_s": 3e-4,
}


def _shape(rng: random.Random) -> StepShape:
    """A step of a few sequences, each a decode or a prefill chunk after some context."""
    block = rng.choice([1, 16, 64, 256])
    items = []
    for _ in range(rng.randint(1, 8)):
        start = rng.randint(0, 600)
        n = 1 if rng.random() < 0.6 else rng.randint(2, 400)
        items.append((start, n))
    return StepShape(
        num_batched_tokens=sum(n for _, n in items),
        kv_read_tokens=sum(s + n for s, n in items),
        attention_pairs=sum(n * s + n * (n + 1) // 2 for s, n in items),
        num_seqs=len(items),
        num_decode_seqs=sum(n == 1 and s > 0 for s, n in items),
        kv_blocks_read=sum(-(-(s + n) // block) for s, n in items),
        block_size=block,
    )


def _true_seconds(shape: StepShape) -> float:
    """The cost written out term by term (independent of the code under test)."""
    return (
        0.03
        + 0.002 * shape.num_batched_tokens
        + 0.004 * shape.num_seqs
        + 2e-5 * shape.kv_read_tokens
        + 1e-7 * shape.attention_pairs
        + 3e-4 * shape.kv_blocks_read
    )


def _samples(n: int = 120, seed: int = 0) -> list[TimedStep]:
    rng = random.Random(seed)
    return [TimedStep(s, _true_seconds(s)) for s in (_shape(rng) for _ in range(n))]


def test_step_time_is_the_weighted_sum_of_the_features():
    shape = StepShape(10, 50, 100, 3, 2, 7, 16)
    model = ProfiledCostModel(TRUE)
    # 0.03 + 0.002*10 + 0.004*3 + 2e-5*50 + 1e-7*100 + 3e-4*7 = 0.06511
    assert model.step_time_s(shape) == pytest.approx(0.06511)


def test_the_fit_recovers_the_coefficients_it_was_generated_with():
    model = fit_cost(_samples())
    for name, value in TRUE.items():
        assert model.coefficients[name] == pytest.approx(value, rel=1e-6), name


def test_a_disturbed_step_is_left_out_and_the_coefficients_still_recovered():
    samples = _samples()
    samples[5] = TimedStep(samples[5].shape, samples[5].seconds * 3)  # another process ran
    plain = fit_cost(samples)
    assert plain.coefficients != pytest.approx(TRUE, rel=1e-3)  # the spike bends a plain fit
    model, kept = fit_robust(samples)
    assert len(kept) == len(samples) - 1 and samples[5] not in kept
    for name, value in TRUE.items():
        assert model.coefficients[name] == pytest.approx(value, rel=1e-6), name


def _decode(num_seqs: int, context: int) -> StepShape:
    return StepShape(num_seqs, num_seqs * context, num_seqs * context, num_seqs, num_seqs,
                     num_seqs * -(-context // 16), 16)  # fmt: skip


def test_token_offsets_interpolate_between_fitted_counts():
    model = ProfiledCostModel({"per_step_s": 1.0}, {1: -0.2, 4: 0.1})
    assert [model.step_time_s(_decode(n, 10)) for n in (1, 2, 3, 4, 5)] == pytest.approx(
        [0.8, 0.9, 1.0, 1.1, 1.0]  # beyond the largest fitted count: the line itself
    )


def test_the_fit_recovers_the_kernel_offsets_of_few_rows():
    # As measured on this project's CPU: 2-3 rows slower than the line, 1 row faster.
    bump = {1: -0.01, 2: 0.04, 3: 0.035}
    shapes = [s.shape for s in _samples()]
    shapes += [_decode(n, context) for n in (1, 2, 3, 4, 6, 8) for context in (50, 200, 400)]
    samples = [TimedStep(s, _true_seconds(s) + bump.get(s.num_batched_tokens, 0)) for s in shapes]
    model, kept = fit_robust(samples)
    assert len(kept) == len(samples)
    for name, value in TRUE.items():
        assert model.coefficients[name] == pytest.approx(value, rel=1e-6), name
    assert {1, 2, 3, 4, 6, 8} <= set(model.token_offsets_s)
    for n, offset in model.token_offsets_s.items():
        assert offset == pytest.approx(bump.get(n, 0.0), abs=1e-9), n
    without = fit_cost(samples, offsets=False)  # the line alone cannot follow the bump
    assert without.coefficients != pytest.approx(TRUE, rel=1e-2)


def test_too_few_steps_get_no_offsets():
    # 12 steps, 6 line coefficients + 6 counts = 12 unknowns: the line alone.
    samples = [TimedStep(_decode(n, 100), 0.05 + 0.01 * n) for n in (1, 2, 3, 4, 5, 6) * 2]
    model = fit_cost(samples)
    assert model.token_offsets_s == {}
    assert model.step_time_s(_decode(3, 100)) == pytest.approx(0.08)


def test_coefficients_never_go_negative():
    # Time falls slightly with the number of sequences: an unconstrained fit would price a
    # sequence below zero. The constrained one sets that cost to 0 and keeps the rest >= 0.
    rng = random.Random(1)
    samples = []
    for _ in range(60):
        shape = _shape(rng)
        seconds = 0.05 + 0.002 * shape.num_batched_tokens - 0.001 * shape.num_seqs
        samples.append(TimedStep(shape, seconds))
    model = fit_cost(samples)
    assert all(v >= 0 for v in model.coefficients.values())
    assert model.coefficients["per_seq_s"] == 0


def test_a_feature_never_seen_is_priced_zero():
    rng = random.Random(2)
    shapes = [StepShape(rng.randint(1, 500), 0, 0) for _ in range(20)]  # no block-aware fields
    model = fit_cost([TimedStep(s, 0.01 + 0.001 * s.num_batched_tokens) for s in shapes])
    assert model.coefficients["per_step_s"] == pytest.approx(0.01)
    assert model.coefficients["per_batched_token_s"] == pytest.approx(0.001)
    assert model.coefficients["per_kv_block_s"] == 0


def test_a_profile_round_trips_and_drives_the_simulator(tmp_path):
    profile = build_profile(_samples(), {"model": "m", "machine": "here", "threads": 1})
    path = tmp_path / "p.json"
    profile.write(path)
    cost = load_cost_profile(path)
    assert cost.coefficients == pytest.approx(TRUE, rel=1e-6)
    assert cost.token_offsets_s == profile.model.token_offsets_s
    assert all(abs(v) < 1e-9 for v in cost.token_offsets_s.values())  # noise-free: none
    assert str(path) in cost.source and "here" in cost.source
    fresh = FreshSegments()
    requests = [TraceRequest(0.0, fresh.take(20), 3), TraceRequest(0.0, fresh.take(5), 1)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    run = Simulation(requests, get_policy("vllm"), 256, config, cost).run()
    # Step 1 prefills both prompts (25 tokens, 2 seqs, blocks 2 + 1 of 16); request 2 is done.
    # Steps 2 and 3 decode request 1 at contexts 21 and 22 (2 blocks each).
    step1 = 0.03 + 0.002 * 25 + 0.004 * 2 + 2e-5 * 25 + 1e-7 * (210 + 15) + 3e-4 * 3
    step2 = 0.03 + 0.002 + 0.004 + 2e-5 * 21 + 1e-7 * 21 + 3e-4 * 2
    step3 = 0.03 + 0.002 + 0.004 + 2e-5 * 22 + 1e-7 * 22 + 3e-4 * 2
    assert run.duration_s == pytest.approx(step1 + step2 + step3)
    assert run.records[1].finish_s == pytest.approx(step1)


def _profile_dict() -> dict:
    return build_profile(_samples(20), {"model": "m"}).to_dict()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("coefficients"), "missing key 'coefficients'"),
        (lambda d: d.update(version=2), "cost profile version 2 is not supported"),
        (lambda d: d.update(format="other"), "not a pagedkv cost profile"),
        (lambda d: d["coefficients"].pop("per_seq_s"), r"missing \['per_seq_s'\]"),
        (lambda d: d["coefficients"].update(per_gpu_s=1.0), r"unknown \['per_gpu_s'\]"),
        (lambda d: d["coefficients"].update(per_step_s=-1.0), "per_step_s must be a finite"),
        (lambda d: d["coefficients"].update(per_step_s="1"), "per_step_s must be a number"),
        (lambda d: d["samples"][3].pop("seconds"), r"samples\[3\] must hold exactly"),
        (lambda d: d.update(samples=5), "'samples' must be a list"),
        (lambda d: d.update(fit=[]), "'fit' must be an object"),
        (lambda d: d.pop("token_offsets_s"), "missing key 'token_offsets_s'"),
        (lambda d: d.update(token_offsets_s={"0": 1.0}), "'0' is not a token count >= 1"),
        (lambda d: d.update(token_offsets_s={"x": 1.0}), "'x' is not a token count"),
        (lambda d: d.update(token_offsets_s={"2": "a"}), r"token_offsets_s.2 must be a number"),
    ],
)
def test_a_bad_profile_is_one_usage_error_naming_the_file(tmp_path, edit, message):
    data = _profile_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=message) as e:
        load_cost_profile(path)
    assert str(e.value).startswith(f"{path}: ")


def test_not_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{\n "format": "pagedkv-cost-profile",\n oops\n}')
    with pytest.raises(UsageError, match=rf"^{path}:3: not JSON"):
        load_cost_profile(path)


def test_a_json_that_is_not_an_object_or_a_missing_file(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(UsageError, match=rf"^{path}: not a pagedkv cost profile"):
        load_cost_profile(path)
    with pytest.raises(UsageError, match="cannot read cost profile .*nope.json"):
        load_cost_profile(tmp_path / "nope.json")


def test_the_model_refuses_unknown_or_negative_coefficients():
    with pytest.raises(ValueError, match="unknown cost coefficients"):
        ProfiledCostModel({"per_warp_s": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        ProfiledCostModel({"per_step_s": -0.1})
    assert set(FEATURES) == set(TRUE)


def test_a_device_profile_names_its_device_and_a_cpu_one_its_cpu():
    """A profile measured on a GPU names the GPU (and the host beside it), not the host CPU
    alone (the H200 check's profile described itself as "on Intel(R) Xeon(R) Processor")."""
    samples = [TimedStep(StepShape(n, n, n, 1), 0.01 + 1e-4 * n) for n in (1, 2, 4, 8, 16, 32)]
    meta = {"model": "m", "machine": "Intel Xeon (16 cores)", "threads": 16, "clock": "wall"}
    cpu = build_profile(samples, meta).describe()
    assert "on Intel Xeon (16 cores) (16 thread(s), wall clock)" in cpu
    gpu = build_profile(samples, {**meta, "device": "device cuda:0 (NVIDIA H200), bfloat16, "
                                  "attention triton"}).describe()  # fmt: skip
    assert "on cuda:0 (NVIDIA H200), bfloat16, attention triton; host Intel Xeon" in gpu
