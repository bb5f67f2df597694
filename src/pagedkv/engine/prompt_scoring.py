"""Prompt log-probabilities: how likely the model found each prompt token, from the prefill.

The prefill of a request with ``prompt_logprobs`` already computes the hidden state of every
prompt position; ``ModelRunner`` hands back those of the positions it scored
(``PromptHidden``), and this module turns them into, per prompt token after the first: its
log-probability, its rank (1 = the most likely token) and the ``k`` most likely alternatives.
Chunked prefill scores each chunk as it runs. Such a request never takes a prefix-cache hit
(``Seq.scores_prompt``): a reused block has no logits, so every position is computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.engine.outputs import PromptTokenScore
from pagedkv.engine.requests import RequestState
from pagedkv.engine.runner import PromptHidden
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sched.sequence import Seq

# Rows of the vocabulary-wide logits held at once: 256 x 49k fp32 is 50 MB, not a prompt's GBs.
SCORE_ROWS = 256


def score_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
) -> list[PromptTokenScore]:
    """Score ``targets[j]`` under the distribution of ``hidden[j]`` (one row per target)."""
    scores: list[PromptTokenScore] = []
    for lo in range(0, len(targets), SCORE_ROWS):
        log_probs = compute_logits(hidden[lo : lo + SCORE_ROWS]).float().log_softmax(dim=-1)
        ids = torch.tensor(
            targets[lo : lo + SCORE_ROWS], dtype=torch.int64, device=log_probs.device
        )
        chosen = log_probs.gather(1, ids.unsqueeze(1))
        ranks = (log_probs > chosen).sum(dim=1) + 1
        if k > 0:
            values, top_ids = log_probs.topk(k, dim=-1)
            tops = [
                list(zip(i, v, strict=True))
                for i, v in zip(top_ids.cpu().tolist(), values.cpu().tolist(), strict=True)
            ]
        else:
            tops = [[] for _ in range(len(ids))]
        host = chosen.squeeze(1).cpu().tolist(), ranks.cpu().tolist()  # prompt logprobs' copy
        for lp, rank, top in zip(*host, tops, strict=True):
            scores.append(PromptTokenScore(lp, rank, top))
    return scores


def score_prompts(
    batch: ScheduledBatch,
    prompt_hidden: list[PromptHidden],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    state_of: Callable[[Seq], RequestState | None],
) -> None:
    """Score every span of the step into its request (``RequestState.record_prompt``)."""
    for span in prompt_hidden:
        seq = batch.seqs[span.entry].seq
        state = state_of(seq)
        if state is None or state.params.prompt_logprobs is None:
            continue
        first = span.first_position + 1
        targets = list(seq.prompt_token_ids[first : first + len(span.hidden)])
        k = state.params.prompt_logprobs
        state.record_prompt(first, score_rows(compute_logits, span.hidden, targets, k))
