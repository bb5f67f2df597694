"""Biases and penalties on the logits (engine/step/logits_processing.py) and min-p (the sampler),
each against values computed by hand; then through the engine on the embedded model."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.engine import SamplingParams
from pagedkv.engine.step.logits_processing import RowTokens, process_logits
from pagedkv.engine.step.sampler import _truncate, sample

from ..conftest import assert_no_leaks


def _one(logits: list[float], params: SamplingParams, tokens: RowTokens) -> list[float]:
    return process_logits(torch.tensor([logits]), [params], [tokens])[0].tolist()


NONE = RowTokens((), (), ())


def test_logit_bias_is_added_to_its_tokens() -> None:
    out = _one([0.0, 1.0, 2.0, 3.0], SamplingParams(logit_bias={2: 5.0, 0: -1.5}), NONE)
    assert out == [-1.5, 1.0, 7.0, 3.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # seen: token 0 (prompt) and 1 (output); 2 and 3 untouched
    tokens = RowTokens(prompt_ids=(0,), output_ids=(1,), stop_ids=())
    out = _one([2.0, -2.0, 1.0, 0.5], SamplingParams(repetition_penalty=2.0), tokens)
    assert out == [1.0, -4.0, 1.0, 0.5]


def test_frequency_and_presence_penalties_count_generated_tokens() -> None:
    # output 3, 3, 1: token 3 seen twice (2 x 0.5 + 1), token 1 once (0.5 + 1); the prompt's
    # token 0 is not counted (OpenAI's rule: penalties on the completion only)
    tokens = RowTokens(prompt_ids=(0,), output_ids=(3, 3, 1), stop_ids=())
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    assert _one([1.0, 1.0, 1.0, 1.0], params, tokens) == [1.0, -0.5, 1.0, -1.0]


def test_min_tokens_masks_the_stop_ids_until_enough_were_generated() -> None:
    params = SamplingParams(min_tokens=3, max_tokens=8)
    early = _one([5.0, 1.0, 0.0], params, RowTokens((7,), (1, 1), stop_ids={0}))
    assert early == [-math.inf, 1.0, 0.0]
    enough = _one([5.0, 1.0, 0.0], params, RowTokens((7,), (1, 1, 1), stop_ids={0}))
    assert enough == [5.0, 1.0, 0.0]


def test_rows_without_processing_are_the_same_tensor() -> None:
    logits = torch.zeros(2, 4)
    assert process_logits(logits, [SamplingParams()] * 2, [NONE, None]) is logits


def test_min_p_drops_tokens_below_its_share_of_the_top_one() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    off = torch.tensor([0]), torch.tensor([1.0])
    # min_p 0.35: keep p >= 0.175 -> tokens 0 and 1
    kept = _truncate(logits, *off, torch.tensor([0.35])).softmax(-1)[0]
    assert kept.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert _truncate(logits, *off, torch.tensor([0.0])).softmax(-1)[0].tolist() == pytest.approx(
        probs[0].tolist()
    )


def test_greedy_follows_the_processed_logits_and_logprobs_stay_the_models() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0]])
    params = [SamplingParams(logit_bias={2: 10.0}, logprobs=0)]
    result = sample(logits, params, [None], [NONE])
    assert result.token_ids == [2]
    assert result.logprobs[0] == pytest.approx(float(logits.log_softmax(-1)[0, 2]))


def test_the_engine_applies_bias_and_min_tokens_per_request(make_engine) -> None:
    engine = make_engine()
    prompt = "Count to ten: one, two,"
    plain = engine.generate([prompt], SamplingParams(max_tokens=4))[0].outputs[0].token_ids
    forced = SamplingParams(max_tokens=4, logit_bias={17: 100.0})  # 17 outranks everything
    # the first plain token becomes a stop id: without min_tokens it ends the request at once
    stop = SamplingParams(max_tokens=4, stop_token_ids=(plain[0],), ignore_eos=True)
    held = SamplingParams(max_tokens=4, stop_token_ids=(plain[0],), ignore_eos=True,
                          min_tokens=3)  # fmt: skip
    out = engine.generate([prompt] * 4, [SamplingParams(max_tokens=4), forced, stop, held])
    assert out[0].outputs[0].token_ids == plain  # neighbours in the batch change nothing
    assert out[1].outputs[0].token_ids == [17] * 4
    assert out[2].outputs[0].token_ids == [plain[0]]
    held_ids = out[3].outputs[0].token_ids
    assert len(held_ids) >= 3 and plain[0] not in held_ids[:3]
    assert_no_leaks(engine)
