"""What a request's biases and penalties do to its logits before the sampler chooses.

Each row is processed from its own sequence's tokens, in vLLM's order: ``min_tokens`` first
(EOS and the stop token ids are masked while fewer than ``min_tokens`` tokens were generated),
then ``logit_bias`` (added), then ``repetition_penalty`` (every token seen in the prompt or the
output: a positive logit divided by it, a negative one multiplied), then ``frequency_penalty``
and ``presence_penalty`` (OpenAI's: ``count x frequency + (count > 0) x presence`` subtracted,
counting generated tokens only). ``SamplingParams`` validates every value. Rows whose params
process nothing are left untouched and cost nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine.device_copies import to_device
from pagedkv.engine.params import SamplingParams


@dataclass(frozen=True)
class RowTokens:
    """The tokens a row's processing reads: its sequence's prompt and output so far, and the
    ids that would end it (EOS unless ignored, plus ``stop_token_ids``)."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    stop_ids: Collection[int]


def process_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[RowTokens | None]
) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` (fp32) with each row's processing applied (module
    docstring); the input itself when no row processes anything, else a new tensor."""
    todo = [i for i, p in enumerate(params) if p.processes_logits and rows[i] is not None]
    if not todo:
        return logits
    out = logits.clone()
    dev = out.device  # index tensors go where the logits are, from pinned memory on a GPU
    for i in todo:
        p, tokens, row = params[i], rows[i], out[i]
        assert tokens is not None
        if p.min_tokens and len(tokens.output_ids) < p.min_tokens and tokens.stop_ids:
            row[to_device(sorted(tokens.stop_ids), torch.int64, dev)] = float("-inf")
        if p.logit_bias:
            ids = to_device([t for t, _ in p.logit_bias], torch.int64, dev)
            biases = to_device([b for _, b in p.logit_bias], row.dtype, dev)
            row.index_add_(0, ids, biases)
        if p.repetition_penalty != 1.0:
            seen = to_device(sorted({*tokens.prompt_ids, *tokens.output_ids}), torch.int64, dev)
            values = row[seen]
            r = p.repetition_penalty
            row[seen] = torch.where(values > 0, values / r, values * r)
        if (p.frequency_penalty or p.presence_penalty) and tokens.output_ids:
            # counted on the host, where the ids are (a device bincount reads its max back)
            counted = Counter(tokens.output_ids)
            ids = to_device(list(counted), torch.int64, dev)
            counts = to_device(list(counted.values()), row.dtype, dev)
            row[ids] -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * (
                p.presence_penalty
            )
    return out
