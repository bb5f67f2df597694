"""The sampler: logits of the sequences that need a token -> next token ids (+ logprobs).

Each row's biases and penalties are applied first (``engine/logits_processing.py``, from its
sequence's own tokens); then temperature, top-k, top-p and min-p are applied to the whole batch
at once; only the random draw is per row, because each seeded request owns a
``torch.Generator`` (so its tokens do not depend on which other requests share the batch).
Greedy rows take the argmax of the processed logits and draw nothing. Reported logprobs are the
model's own (before processing, temperature and truncation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.engine.grammar import accept, apply_masks
from pagedkv.engine.logits_processing import RowTokens, process_logits
from pagedkv.engine.params import SamplingParams
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sched.sequence import Seq


@dataclass(frozen=True)
class SampleResult:
    """Per row: the chosen token id, its log-probability under the model (before temperature
    and truncation), and the top alternatives ``[(token_id, logprob)]`` when asked for."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def _truncate(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, nucleus top-p and min-p (tokens
    less likely than ``min_p`` x the most likely one, after top-k)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k.unsqueeze(-1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass before it is below top_p. The most likely token always stays,
    # whatever rounding does to top_p, so a row can never be left with nothing to draw.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    drop |= probs < min_p.unsqueeze(-1) * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    tokens: list[RowTokens | None] | None = None,
    matchers: list[Any | None] | None = None,
) -> SampleResult:
    """Pick one token per row of ``logits`` ``[rows, vocab]`` (fp32). ``generators[i]`` is the
    row's seeded generator or None (global RNG); ``tokens[i]`` what its logit processing reads
    (None: no processing); ``matchers[i]`` the grammar the token must follow (None: free).
    Mutates the generators' states only (the caller advances the matchers)."""
    rows, vocab = logits.shape
    logits = logits.float()
    processed = process_logits(logits, params, tokens or [None] * rows)
    if matchers is not None:
        apply_masks(processed, matchers)
    greedy = [p.greedy for p in params]
    chosen = processed.argmax(dim=-1)
    if not all(greedy):
        dev = logits.device  # the logits' device: a GPU's stay there
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        top_k = torch.tensor([min(p.top_k, vocab) for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=dev)
        scaled = processed / temps.unsqueeze(-1)
        probs = _truncate(scaled, top_k, top_p, min_p).softmax(dim=-1)
        for i in range(rows):
            if not greedy[i]:
                row, gen = probs[i], generators[i]
                if gen is not None and gen.device != row.device:  # seeds are host generators
                    row = row.cpu()
                chosen[i] = torch.multinomial(row, 1, generator=gen)[0]
    # The step's one host sync: the sampled ids (seeded rows and logprobs add their own).
    token_ids = chosen.cpu().tolist()
    logprobs: list[float | None] = [None] * rows
    top: list[list[tuple[int, float]] | None] = [None] * rows
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asked:
        # Logprobs: one gather (and one top-k) over the rows that asked, one copy to the host.
        rows_asked = torch.tensor(asked, device=logits.device)
        log_probs = logits[rows_asked].log_softmax(dim=-1)
        chosen_lp = log_probs.gather(1, chosen[rows_asked].unsqueeze(1)).squeeze(1)
        k = max(params[i].logprobs or 0 for i in asked)
        values, ids = log_probs.topk(max(k, 1), dim=-1)
        chosen_host, values_host, ids_host = (t.cpu().tolist() for t in (chosen_lp, values, ids))
        for j, i in enumerate(asked):
            logprobs[i] = chosen_host[j]
            if w := params[i].logprobs:
                top[i] = list(zip(ids_host[j][:w], values_host[j][:w], strict=True))
    return SampleResult(token_ids, logprobs, top)


# One batch entry's draws: (token ids, their logprob info, whether a grammar completed),
# num_samples long each.
Draws = tuple[list[int], list[tuple[float | None, list[tuple[int, float]] | None]], list[bool]]


def sample_batch(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    sampling_of: Callable[[Seq], tuple[SamplingParams, int, list[Any] | None]],
) -> list[Draws]:
    """One (token ids, logprob info, grammar complete) triple per entry of ``batch.seqs`` from
    the logits of the entries that need a token (in batch order); n draws for a request's
    first token when it has n samples, each from its own seed. ``sampling_of(seq)`` is (its
    params, its sample index, its request's grammar matchers or None); the matchers of the
    drawn samples accept their tokens here."""
    rows, params, gens, owners = [], [], [], []
    tokens: list[RowTokens | None] = []
    matchers: list[Any | None] = []
    r = 0
    for i, item in enumerate(batch.seqs):
        if not item.needs_logits:
            continue
        p, first, grammar = sampling_of(item.seq)
        seq = item.seq
        position = seq.num_output_tokens
        row_tokens = None
        if p.processes_logits:
            row_tokens = RowTokens(seq.prompt_token_ids, seq.output_token_ids, seq.stop_token_ids)
        for j in range(item.num_samples):
            rows.append(r)
            params.append(p)
            gens.append(seeded_generator(p.sample_seed(first + j), position))
            owners.append(i)
            tokens.append(row_tokens)
            matchers.append(grammar[first + j] if grammar else None)
        r += 1
    out: list[Draws] = [([], [], []) for _ in batch.seqs]
    if rows:
        constrained = matchers if any(m is not None for m in matchers) else None
        result = sample(logits[torch.tensor(rows)], params, gens, tokens, constrained)
        for k, i in enumerate(owners):
            token = result.token_ids[k]
            out[i][0].append(token)
            out[i][1].append((result.logprobs[k], result.top_logprobs[k]))
            out[i][2].append(matchers[k] is not None and accept(matchers[k], token))
    return out


_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive seeds apart before mixing in the position


def seeded_generator(seed: int | None, position: int) -> torch.Generator | None:
    """The generator for output token ``position`` of a sample seeded ``seed`` (None: use the
    global RNG). Stateless: the draw depends only on (seed, position), so a sample's tokens do
    not depend on batching, preemption or whether it was forked from a parent."""
    if seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed((seed * _GOLDEN + position) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen
