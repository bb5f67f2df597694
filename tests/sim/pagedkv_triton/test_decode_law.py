"""The paged decode laws of pagedkv's kernel (``sim/pagedkv_triton/decode_law.py``): hand-computed prices, and
fits that recover the parameters of ledger rows made from known ones."""

from __future__ import annotations

import math

import pytest

from pagedkv.pages.triton_splits import decode_splits
from pagedkv.sim.gpus import get_gpu
from pagedkv.sim.pagedkv_triton.decode_law import (
    LAWS,
    DecodeCall,
    LedgerRow,
    check_params,
    choose_law,
    decode_call_s,
    fit_law,
    token_cost_ratio,
)

pytest.importorskip("scipy")
GPU = get_gpu("H200-141GB")  # 4.8 TB/s, 132 SMs
WALK = {"launch_s": 9e-6, "split_s": 3e-6, "iter_s": 1.1e-6, "iter_per_byte_s": 1.5e-11,
        "resident_per_sm": 3.4, "bw_eff": 0.87}  # fmt: skip


def call(batch: int, context: int, b: int, splits: int = 1) -> DecodeCall:
    return DecodeCall(batch, context, b, splits, kv_heads=8, head_dim=128, element_bytes=2)


def test_walk_law_by_hand() -> None:
    """One sequence, 1,024 tokens in blocks of 16, one pass: 8 programs (under 3.4 x 132
    resident), 64 blocks each of 1.1 us + 1.5e-11 x 8,192 bytes; the bandwidth floor is far
    below, so the soft maximum is the walk to 1e-4."""
    walk = 64 * (1.1e-6 + 1.5e-11 * 8192)
    floor = 1 * 8 * 64 * 8192 / (4.8e12 * 0.87)
    expected = 9e-6 + (walk**4 + floor**4) ** 0.25
    assert decode_call_s("walk", WALK, GPU, call(1, 1024, 16)) == pytest.approx(expected)
    assert expected == pytest.approx(9e-6 + walk, rel=1e-4)
    # A split adds its combine launch and shortens the chain: 64 blocks in 4 parts of 16.
    split = decode_call_s("walk", WALK, GPU, call(1, 1024, 16, splits=4))
    assert split == pytest.approx(9e-6 + 3e-6 + 16 * (1.1e-6 + 1.5e-11 * 8192), rel=1e-3)


def test_bandwidth_and_overhead_laws_by_hand() -> None:
    bw = {"launch_s": 0.0, "split_s": 0.0, "bw_eff": 1.0}
    # 256 sequences x 4,096 tokens x 8 heads x 128 x 2 (K, V) x 2 bytes at 4.8 TB/s
    seconds = 256 * 4096 * 8 * 128 * 4 / 4.8e12
    assert decode_call_s("bandwidth", bw, GPU, call(256, 4096, 16)) == pytest.approx(seconds)
    over = {**bw, "overhead_at_16": 0.5}
    assert decode_call_s("overhead", over, GPU, call(256, 4096, 16)) == pytest.approx(1.5 * seconds)
    assert decode_call_s("overhead", over, GPU, call(256, 4096, 64)) == pytest.approx(
        1.125 * seconds
    )
    # the tail block is read whole: 1,000 tokens in blocks of 256 read 1,024
    assert decode_call_s("bandwidth", bw, GPU, call(1, 1000, 256)) == pytest.approx(
        8 * 1024 * 128 * 4 / 4.8e12
    )


def test_token_cost_ratio() -> None:
    assert token_cost_ratio("bandwidth", {}, 64, 16) == 1.0
    assert token_cost_ratio("overhead", {"overhead_at_16": 1.0}, 64, 16) == pytest.approx(1.25 / 2)
    p = {"iter_s": 1e-6, "iter_per_byte_s": 1e-11}
    per16, per64 = (1e-6 + 1e-11 * 8192) / 16, (1e-6 + 1e-11 * 32768) / 64
    assert token_cost_ratio("walk", p, 64, 16) == pytest.approx(per64 / per16)


def _ledger(law: str, params: dict[str, float]) -> list[LedgerRow]:
    """The device check's grid (B x context x batch, the kernel's split rule and one pass)
    priced by ``law`` with ``params``: measurements without noise."""
    rows = []
    for context in (1024, 4096, 16384, 32768):
        for batch in (1, 8, 32, 128, 256):
            for b in (16, 32, 64, 128, 256):
                rule = decode_splits(batch, 8, context, GPU.num_sms)
                for splits in {rule, 1}:
                    c = call(batch, context, b, splits)
                    rows.append(LedgerRow(c, decode_call_s(law, params, GPU, c)))
    return rows


def test_fit_recovers_the_walk_laws_parameters() -> None:
    fitted = fit_law("walk", _ledger("walk", WALK), GPU)
    for name, value in WALK.items():
        assert fitted[name] == pytest.approx(value, rel=0.02), name


def test_the_data_chooses_the_law_it_was_made_from() -> None:
    chosen, scores = choose_law(_ledger("walk", WALK), GPU)
    assert chosen.law == "walk" and chosen.loco_median_err < 0.005
    assert {s.law for s in scores} == set(LAWS)
    # rows with no per-block cost: a law without one fits them exactly (held-out too)
    flat = _ledger("bandwidth", {"launch_s": 5e-6, "split_s": 4e-6, "bw_eff": 0.9})
    chosen, scores = choose_law(flat, GPU)
    assert chosen.loco_median_err < 0.005
    bandwidth = next(s for s in scores if s.law == "bandwidth")
    assert bandwidth.params["bw_eff"] == pytest.approx(0.9, rel=0.01)


@pytest.mark.parametrize(
    "law, params, match",
    [
        ("nope", {}, "unknown decode law"),
        ("bandwidth", {"launch_s": 0.0, "split_s": 0.0}, "takes"),
        ("bandwidth", {"launch_s": 0.0, "split_s": 0.0, "bw_eff": 0.0}, "bw_eff"),
        ("bandwidth", {"launch_s": -1.0, "split_s": 0.0, "bw_eff": 1.0}, "launch_s"),
        ("bandwidth", {"launch_s": math.nan, "split_s": 0.0, "bw_eff": 1.0}, "launch_s"),
    ],
)
def test_bad_parameters_are_refused(law, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_params(law, params)


def test_the_longest_sequence_ends_the_launch() -> None:
    """One wave (8 sequences x 8 heads): every program starts at once, so the launch lasts the
    longest chain, 128 blocks, not the mean's 64; many waves: the mean walk, then what the
    longest chain has beyond the mean one. Equal contexts price as before."""
    it = 1.1e-6 + 1.5e-11 * 8192
    mixed = DecodeCall(8, 1024, 16, 1, 8, 128, 2, longest_tokens=2048)
    assert decode_call_s("walk", WALK, GPU, mixed) == pytest.approx(9e-6 + 128 * it, rel=1e-3)
    assert decode_call_s("walk", WALK, GPU, call(8, 1024, 16)) == pytest.approx(
        9e-6 + 64 * it, rel=1e-3
    )
    waves = 256 * 8 / (3.4 * GPU.num_sms)
    long = DecodeCall(256, 1024, 16, 1, 8, 128, 2, longest_tokens=2048)
    floor = 256 * 8 * 64 * 8192 / (4.8e12 * 0.87)
    walk = (64 * waves + 64) * it
    assert decode_call_s("walk", WALK, GPU, long) == pytest.approx(
        9e-6 + (walk**4 + floor**4) ** 0.25
    )
    same = DecodeCall(256, 1024, 16, 1, 8, 128, 2, longest_tokens=1024)
    assert decode_call_s("walk", WALK, GPU, same) == decode_call_s(
        "walk", WALK, GPU, call(256, 1024, 16)
    )


def _list_schedule_s(contexts: list[int], block_size: int) -> float:
    """The walk law's launch by brute force: programs (sequence fastest, then KV head, the
    grid's order) start as slots free up, each its chain of block iterations."""
    import heapq

    it = WALK["iter_s"] + WALK["iter_per_byte_s"] * 2 * block_size * 128 * 2
    slots = [0.0] * int(WALK["resident_per_sm"] * GPU.num_sms)
    for _head in range(8):
        for c in contexts:
            heapq.heappush(slots, heapq.heappop(slots) + math.ceil(c / block_size) * it)
    return max(slots)


@pytest.mark.parametrize("batch", [246, 160, 40])
def test_the_tail_term_follows_a_list_schedule(batch: int) -> None:
    """A batch of contexts spread over 64..2,048 tokens (a real step's): the closed form (mean
    walk + the longest chain beyond the mean) within 10 % of the brute-force list schedule,
    where the mean alone misses by 20 % or more."""
    contexts = [64 + (2048 - 64) * i // (batch - 1) for i in range(batch)]
    mean = sum(contexts) / batch
    brute = _list_schedule_s(contexts, 16)
    no_floor = {**WALK, "launch_s": 0.0, "bw_eff": 1e9}  # the walk alone, as brute force
    tail = DecodeCall(batch, mean, 16, 1, 8, 128, 2, longest_tokens=max(contexts))
    assert decode_call_s("walk", no_floor, GPU, tail) == pytest.approx(brute, rel=0.10)
    assert decode_call_s("walk", no_floor, GPU, call(batch, round(mean), 16)) < 0.8 * brute
