"""A step's draws, in two halves: ``launch`` queues them on the device (the sampler's ``draw``,
no host sync), ``collect`` copies them to the host once and advances the grammars. A
synchronous engine runs both back to back (``sample_batch``); an asynchronous one launches a
step's draws, then the next step's forward pass, which reads the drawn ids straight from the
device (``PendingDraws.token_rows``), and collects while that pass runs. Grammars advance in
``collect`` only, entry by entry and all or none, so a failure anywhere before or inside it
leaves every other request's matchers as its text says (a retry masks from the same state)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.engine.device_copies import to_device
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.step.logits_processing import RowTokens
from pagedkv.engine.step.sampler import DeviceDraws, draw, seeded_generator, to_host
from pagedkv.engine.structured.grammar import advance
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sched.sequence import Seq

# One batch entry's draws: (token ids, their logprob info, whether a grammar completed),
# num_samples long each.
Draws = tuple[list[int], list[tuple[float | None, list[tuple[int, float]] | None]], list[bool]]


@dataclass(frozen=True)
class PendingDraws:
    """A step's draws queued on the device. ``owners[k]``: the entry of ``batch.seqs`` row
    ``k`` draws for; ``token_rows``: each drawing sequence's first row (``draws.token_ids[row]``
    is its next token, which the next step may compute before the host sees it)."""

    batch: ScheduledBatch
    owners: list[int]
    matchers: list[Any | None]
    draws: DeviceDraws | None  # None: no entry needed a token
    token_rows: dict[int, int]


def launch(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    sampling_of: Callable[[Seq], tuple[SamplingParams, int, list[Any] | None]],
) -> PendingDraws:
    """Queue the draws of the entries of ``batch`` that need a token and still run, from
    ``logits`` (their rows, in batch order); n draws for a request's first token when it has n samples, each
    from its own seed. ``sampling_of(seq)`` is (its params, its sample index, its request's
    grammar matchers or None). Reads each sequence's known tokens (penalties, the seeded
    draw's position): call it once the previous step's tokens are recorded."""
    rows, params, gens, owners = [], [], [], []
    tokens: list[RowTokens | None] = []
    matchers: list[Any | None] = []
    token_rows: dict[int, int] = {}
    r = 0
    for i, item in enumerate(batch.seqs):
        if not item.needs_logits:
            continue
        seq = item.seq
        if seq.is_finished:  # it stopped (or was aborted) since: its row is not drawn
            r += 1
            continue
        p, first, grammar = sampling_of(seq)
        known_outputs = seq.output_token_ids  # a placeholder scheduled ahead left out
        row_tokens = None
        if p.processes_logits:
            row_tokens = RowTokens(seq.prompt_token_ids, known_outputs, seq.stop_token_ids)
        token_rows[seq.seq_id] = len(rows)
        for j in range(item.num_samples):
            rows.append(r)
            params.append(p)
            gens.append(
                seeded_generator(p.sample_seed(first + j), len(known_outputs), logits.device)
            )
            owners.append(i)
            tokens.append(row_tokens)
            matchers.append(grammar[first + j] if grammar else None)
        r += 1
    drawn = None
    if rows:
        constrained = matchers if any(m is not None for m in matchers) else None
        index = to_device(rows, torch.int64, logits.device)
        drawn = draw(logits[index], params, gens, tokens, constrained)
    return PendingDraws(batch, owners, matchers, drawn, token_rows)


def collect(pending: PendingDraws) -> list[Draws | Exception]:
    """One (token ids, logprob info, grammar complete) triple per entry of the batch, or the
    exception its grammar failed with: the draws copied to the host (this waits for them),
    then each entry's matchers advanced by its tokens, all or none (``grammar.advance``). An
    entry whose grammar fails is that entry's failure alone: every other entry keeps its
    draws, and every matcher stays where its committed text says."""
    out: list[Draws | Exception] = [([], [], []) for _ in pending.batch.seqs]
    if pending.draws is None:
        return out
    result = to_host(pending.draws)
    failed = pending.draws.grammar_errors
    rows_of: dict[int, list[int]] = {}
    for k, i in enumerate(pending.owners):
        rows_of.setdefault(i, []).append(k)
    for i, rows in rows_of.items():
        tokens = [result.token_ids[k] for k in rows]
        try:
            if errors := [failed[k] for k in rows if k in failed]:
                raise errors[0]
            complete = advance([pending.matchers[k] for k in rows], tokens)
        except Exception as exc:  # noqa: BLE001 - this entry's failure, no other's
            out[i] = exc
            continue
        info = [(result.logprobs[k], result.top_logprobs[k]) for k in rows]
        out[i] = (tokens, info, complete)
    return out


def sample_batch(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    sampling_of: Callable[[Seq], tuple[SamplingParams, int, list[Any] | None]],
) -> list[Draws | Exception]:
    """``launch`` then ``collect``: a synchronous step's draws."""
    return collect(launch(batch, logits, sampling_of))
