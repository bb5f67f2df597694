"""pagedkv's own engine clock (``sim/pagedkv_triton/clock.py``, ``engine_cost.py``, ``pagedkv_triton/fit.py``):
the file round-trips and refuses bad input, a step is priced as the docstring says (hand
cases), and the step fit recovers the parameters of steps made from known ones."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pagedkv.errors import UsageError
from pagedkv.pages.sources import load_shape
from pagedkv.sched.step_shape import StepShape, TimedStep
from pagedkv.sim.cost_model import ModelCost
from pagedkv.sim.gpus import get_gpu
from pagedkv.sim.pagedkv_triton.clock import (
    EngineClock,
    clock_to_dict,
    parse_engine_clock,
    read_engine_clock,
    write_engine_clock,
)
from pagedkv.sim.pagedkv_triton.cost import EngineCostModel

GPU = get_gpu("H200-141GB")
MODEL = ModelCost.from_shape(load_shape("llama-3-8b"))
TRUE = EngineClock(
    gpu="H200-141GB", decode_law="walk",
    decode={"launch_s": 9e-6, "split_s": 3e-6, "iter_s": 1.1e-6, "iter_per_byte_s": 1.5e-11,
            "resident_per_sm": 3.4, "bw_eff": 0.87},
    ref_block_size=16, prefill_launch_s=3e-4, prefill_decode_token_s=1.3e-8,
    prefill_pair_s=2e-8, gemm_launch_s=6e-6, gemm_bw_eff=0.96, gemm_flops_eff=0.74,
    gemm_knee=1.5, gpu_per_token_s=2.7e-7, host_base_s=2e-3, host_per_seq_s=2.3e-5,
    launch_per_layer_s=4e-4, overlap_p=3.0, graph_replay_s=3e-4,
    sources={"decode_attention": "made up for a test"},
)  # fmt: skip


def test_a_clock_file_round_trips(tmp_path) -> None:
    path = tmp_path / "clock.json"
    write_engine_clock(path, TRUE, {"device": "NVIDIA H200", "note": [1, 2]})
    clock, meta = read_engine_clock(path)
    assert clock == TRUE
    assert meta["device"] == "NVIDIA H200" and meta["engine"] == "pagedkv-triton"


def _record(**changes) -> dict:
    record = clock_to_dict(TRUE, {})
    record["params"] = {**record["params"], **changes.pop("params", {})}
    return {**record, **changes}


@pytest.mark.parametrize(
    "record, match",
    [
        ([1, 2], "not a pagedkv engine clock"),
        (_record(format="pagedkv-gpu-clock"), "not a pagedkv engine clock"),
        (_record(version=2), "version 2 is not supported"),
        (_record(params={"host_base_s": -1.0}), "host_base_s must be finite and >= 0"),
        (_record(params={"overlap_p": 0.5}), "overlap_p must be >= 1"),
        (_record(params={"gemm_bw_eff": 0.0}), "gemm_bw_eff must be > 0"),
        (_record(params={"decode_law": "magic"}), "unknown decode law"),
        (_record(params={"decode": {"launch_s": 1.0}}), "takes"),
        (_record(params={"ref_block_size": 0}), "ref_block_size must be >= 1"),
        (_record(params={"surprise_s": 1.0}), "unexpected keyword"),
        (_record(params={"host_base_s": "1"}), "must be a number"),
        (_record(sources={"kitchen": "sink"}), "unknown parts"),
        (_record(gpu=7), "needs 'gpu'"),
    ],
)
def test_a_bad_clock_is_refused_naming_the_file(record, match) -> None:
    with pytest.raises(UsageError, match=match) as caught:
        parse_engine_clock(record, "clock.json")
    assert str(caught.value).startswith("clock.json: ")


def test_an_unreadable_file_is_one_usage_error(tmp_path) -> None:
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(UsageError, match="cannot read engine clock"):
        read_engine_clock(tmp_path / "bad.json")


def _decode(n: int, context: int, b: int = 16) -> StepShape:
    return StepShape.of([(context, 1)] * n, b)


def test_eager_and_graph_steps_by_hand() -> None:
    """Eager: host + (launch^p + gpu^p)^(1/p); a graphed decode step: host + replay + gpu;
    with p = 1 the launches and the GPU run in series."""
    shape = _decode(64, 1000)
    eager = EngineCostModel(MODEL, GPU, TRUE, cuda_graphs=False)
    graphs = EngineCostModel(MODEL, GPU, TRUE, cuda_graphs=True)
    gpu, host = eager.gpu_s(shape), 2e-3 + 64 * 2.3e-5
    launch = 4e-4 * 32
    assert eager.host_s(shape) == pytest.approx(host)
    assert eager.step_time_s(shape) == pytest.approx(host + (launch**3 + gpu**3) ** (1 / 3))
    assert graphs.step_time_s(shape) == pytest.approx(host + 3e-4 + gpu)
    serial = EngineCostModel(MODEL, GPU, replace(TRUE, overlap_p=1.0), cuda_graphs=False)
    assert serial.step_time_s(shape) == pytest.approx(host + launch + gpu)
    # a step with a prompt chunk is eager even with graphs on
    mixed = StepShape.of([(1000, 1), (0, 512)], 16)
    assert graphs.step_time_s(mixed) == eager.step_time_s(mixed)


def test_decode_attention_follows_the_kernels_rule_and_the_law() -> None:
    """A decode step's attention is the ledger's law at the kernel's split count (1 sequence of
    4,096 tokens in blocks of 16 on 132 SMs: 33 splits), once per layer."""
    from pagedkv.sim.pagedkv_triton.decode_law import DecodeCall, decode_call_s

    cost = EngineCostModel(MODEL, GPU, TRUE)
    law = decode_call_s("walk", TRUE.decode, GPU, DecodeCall(1, 4096.0, 16, 33, 8, 128, 2))
    assert cost.decode_attention_s(1, 4096.0, 16) == pytest.approx(law)
    # B = 16 costs more than B = 64 at a long context and a full batch (the ledger's finding)
    assert cost.decode_attention_s(256, 4096.0, 16) > 1.25 * cost.decode_attention_s(256, 4096, 64)


def test_a_step_that_knows_its_longest_context_prices_its_last_program() -> None:
    """The simulator's shapes carry the longest context (``LongestShape``): a decode step of
    unequal contexts pays the longest sequence's chain beyond the mean (``decode_law``), and
    splits by the kernel's rule at the longest; a plain ``StepShape`` of the same sums is
    priced at the mean, as is a step of equal contexts."""
    from pagedkv.sim.pagedkv_triton.decode_law import DecodeCall, decode_call_s
    from pagedkv.sim.pagedkv_triton.step_context import LongestShape, longest_context_tokens

    items = [(300 + 8 * i, 1) for i in range(200)] + [(2047, 1)]
    shape = LongestShape.of(items, 16)
    assert shape.max_context_tokens == 2048 and longest_context_tokens(shape) == 2048
    plain = StepShape.of(items, 16)
    assert {k: v for k, v in vars(shape).items() if k != "max_context_tokens"} == vars(plain)
    assert longest_context_tokens(plain) == 0
    cost = EngineCostModel(MODEL, GPU, TRUE, cuda_graphs=True)
    mean = plain.decode_kv_tokens / 201
    law = decode_call_s("walk", TRUE.decode, GPU, DecodeCall(201, mean, 16, 1, 8, 128, 2, 2048))
    assert cost.decode_attention_s(201, mean, 16, 2048) == pytest.approx(law)
    assert cost.step_time_s(shape) - cost.step_time_s(plain) == pytest.approx(
        32 * (law - cost.decode_attention_s(201, mean, 16)), rel=1e-6
    )
    assert cost.step_time_s(shape) > cost.step_time_s(plain)
    equal = [(999, 1)] * 64
    assert cost.step_time_s(LongestShape.of(equal, 16)) == cost.step_time_s(StepShape.of(equal, 16))
    # one sequence of 1,024 tokens beside seven of 16: 64 programs, the rule splits by the
    # longest (264 // 64 = 4, 1,024 // 64 = 16 allow 4), not by the mean of 142 tokens (2)
    few = LongestShape.of([(1023, 1)] + [(15, 1)] * 7, 16)
    mean = few.decode_kv_tokens / 8
    split = DecodeCall(8, mean, 16, 4, 8, 128, 2, 1024)
    assert cost.decode_attention_s(8, mean, 16, 1024) == pytest.approx(
        decode_call_s("walk", TRUE.decode, GPU, split)
    )


def test_mixed_decode_rows_cost_the_prefill_kernels_price() -> None:
    """A mixed step's decode rows go through the prefill kernel: query heads x KV tokens x
    prefill_decode_token_s / SMs more than the same step without them."""
    cost = EngineCostModel(MODEL, GPU, TRUE)
    base = StepShape(512, 512, 512 * 513 // 2, 1, 0, 32, 16, 0)
    with_rows = replace(base, decode_kv_tokens=100_000, attention_pairs=base.attention_pairs
                        + 100_000, kv_read_tokens=100_512)  # fmt: skip
    extra = cost.prefill_attention_s(with_rows) - cost.prefill_attention_s(base)
    assert extra == pytest.approx(32 * 100_000 * 1.3e-8 / 132)


def _synthetic_steps(clock: EngineClock) -> tuple[list[TimedStep], list[TimedStep]]:
    eager_cost = EngineCostModel(MODEL, GPU, clock, cuda_graphs=False)
    graph_cost = EngineCostModel(MODEL, GPU, clock, cuda_graphs=True)
    shapes = [StepShape.of([(0, n)], 16) for n in (64, 512, 2048)]
    shapes += [StepShape.of([(0, 8192 // k)] * k, 16) for k in (4, 32)]
    shapes += [StepShape.of([(c, 1)] * d + [(0, 8192 - d)], 16)
               for d in (16, 64, 128, 200) for c in (300, 900, 1700)]  # fmt: skip
    decode = [_decode(n, c) for n in (1, 4, 16, 32, 64, 128, 256) for c in (200, 800, 2000)]
    eager = [TimedStep(s, eager_cost.step_time_s(s)) for s in shapes + decode]
    graphs = [TimedStep(s, graph_cost.step_time_s(s)) for s in decode]
    return eager, graphs


def test_the_step_fit_recovers_known_parameters() -> None:
    pytest.importorskip("scipy")
    from pagedkv.sim.pagedkv_triton.fit import STARTS, STEP_PARAMS, fit_steps, step_errors

    eager, graphs = _synthetic_steps(TRUE)
    start = replace(TRUE, **STARTS)  # every step parameter away from the truth
    fitted = fit_steps(start, MODEL, GPU, eager, graphs)
    assert max(abs(e) for e in step_errors(fitted, MODEL, GPU, eager, False)) < 0.002
    assert max(abs(e) for e in step_errors(fitted, MODEL, GPU, graphs, True)) < 0.002
    for name in (*STEP_PARAMS, "graph_replay_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name


HOST = replace(TRUE, host_per_table_entry_s=9e-8, host_per_token_s=4e-7)


def test_the_host_by_hand() -> None:
    """Per step, per sequence, per block-table entry (every row padded to the longest
    sequence's blocks) and per new token; a shape that does not know its longest context
    stands in its mean blocks."""
    from pagedkv.sim.pagedkv_triton.step_context import LongestShape

    cost = EngineCostModel(MODEL, GPU, HOST)
    items = [(99, 1)] * 9 + [(2047, 1)]
    shape = LongestShape.of(items, 16)  # width 128, 10 rows
    assert cost.host_s(shape) == pytest.approx(2e-3 + 10 * 2.3e-5 + 10 * 128 * 9e-8 + 10 * 4e-7)
    plain = StepShape.of(items, 16)  # 9 x 7 + 128 = 191 blocks: 20 a row
    assert cost.host_s(plain) == pytest.approx(2e-3 + 10 * 2.3e-5 + 10 * 20 * 9e-8 + 10 * 4e-7)
    assert EngineCostModel(MODEL, GPU, TRUE).host_s(shape) == pytest.approx(2e-3 + 10 * 2.3e-5)


def _host_steps(clock: EngineClock) -> list[TimedStep]:
    """Host-only steps (no forward) of batches of several widths and sizes, priced by ``clock``."""
    from pagedkv.sim.pagedkv_triton.step_context import LongestShape

    cost = EngineCostModel(MODEL, GPU, clock)
    shapes = [
        LongestShape.of([(c, 1)] * (n - 1) + [(longest, 1)], 16)
        for n in (1, 8, 64, 246)
        for c in (100, 800)
        for longest in (500, 2300)
    ]
    shapes += [LongestShape.of([(c, 1)] * d + [(0, 8192 - d)], 16) for d in (16, 200)
               for c in (300, 1700)]  # fmt: skip
    return [TimedStep(s, cost.host_s(s)) for s in shapes]


def test_the_host_fit_recovers_known_parameters_and_the_steps_fit_the_rest() -> None:
    """Host-only steps fix the four host terms (fit_host); the eager and graph steps then fit
    the launches, the overlap, the kernels and the replay with the host held."""
    pytest.importorskip("scipy")
    from pagedkv.sim.pagedkv_triton.fit import HOST_PARAMS, STARTS, STEP_PARAMS, fit_host, fit_steps

    start = replace(TRUE, **STARTS)
    host = fit_host(start, _host_steps(HOST))
    for name in HOST_PARAMS:
        assert getattr(host, name) == pytest.approx(getattr(HOST, name), rel=1e-3), name
    eager, graphs = _synthetic_steps(HOST)
    fitted = fit_steps(host, MODEL, GPU, eager, graphs, host_fixed=True)
    for name in HOST_PARAMS:
        assert getattr(fitted, name) == getattr(host, name)
    for name in (*STEP_PARAMS, "graph_replay_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(HOST, name), rel=0.05), name
    with pytest.raises(ValueError, match="longest context"):
        fit_host(start, _synthetic_steps(TRUE)[1])


def test_plan_json_of_a_triton_backend_names_pagedkvs_clock(capsys) -> None:
    """`plan --gpu H200-141GB --backend triton` prices the time column on the shipped
    pagedkv-triton clock: B = 16 slower than B = 64 (the ledger's latency-bound walk)."""
    from pagedkv.cli import main

    argv = ["plan", "--model", "llama-3-8b", "--gpu", "H200-141GB", "--backend", "triton",
            "--num-seqs", "246", "--mean-len", "1000", "--max-len", "2304",
            "--block-sizes", "16,32,64,128", "--json"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["clock"].startswith("pagedkv-triton clock")
    step = {r["block_size"]: r["decode_step_ms"] for r in plan["rows"]}
    assert step[16] > 1.05 * step[64]
    assert plan["recommendation"]["block_size"] in (32, 64, 128)
