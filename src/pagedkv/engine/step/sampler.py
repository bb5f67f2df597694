"""The sampler: logits of the sequences that need a token -> next token ids (+ logprobs).

Each row's biases and penalties are applied first (``engine/step/logits_processing.py``, from its
sequence's own tokens); then temperature, top-k, top-p and min-p are applied to the whole batch
at once. Greedy rows take the argmax of the processed logits and draw nothing; the unseeded
rows draw in one call; a seeded row draws alone, from a generator of its own (seed, position),
so its tokens do not depend on which other requests share the batch. Reported logprobs are the
model's own (before processing, temperature and truncation). ``draw`` leaves everything on the
logits' device and queues the one copy to the host right behind the draws; ``to_host`` waits for
that copy only (``step/draws.py`` splits a step's draws there). No host sync before it: every
index and parameter tensor goes up from pinned memory (``device_copies.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.engine.device_copies import HostCopy, start_host_copy, to_device
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.step.logits_processing import RowTokens, process_logits
from pagedkv.engine.structured.grammar import GrammarError, apply_masks


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


@dataclass(frozen=True)
class DeviceDraws:
    """A batch's draws before their one copy to the host: ``token_ids`` int64 ``[R]`` on the
    logits' device; for the rows that asked for logprobs (``asked``, with their ``widths``),
    the chosen token's logprob ``[A]`` and the top values and ids ``[A, k]`` (k the widest);
    ``host``: their copies to the host, queued right behind the draws; ``grammar_errors``: the
    rows whose grammar failed computing their mask (their draws are not to be used)."""

    token_ids: torch.Tensor
    asked: list[int]
    widths: list[int]
    host: HostCopy
    chosen_logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    grammar_errors: dict[int, GrammarError] = field(default_factory=dict)


def draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    tokens: list[RowTokens | None] | None = None,
    matchers: list[Any | None] | None = None,
) -> DeviceDraws:
    """Pick one token per row of ``logits`` ``[rows, vocab]`` (fp32), on their device.
    ``generators[i]`` is the row's seeded generator or None (global RNG); ``tokens[i]`` what
    its logit processing reads (None: no processing); ``matchers[i]`` the grammar the token
    must follow (None: free), its mask applied to a copy (the logprobs stay the model's own).
    Mutates the generators' states only (the caller advances the matchers). No host sync: the unseeded rows draw in one call, a seeded row on a GPU by the
    exponential race on its own device generator (``seeded_generator``), on the CPU from its
    host generator."""
    rows, vocab = logits.shape
    logits = logits.float()
    processed = process_logits(logits, params, tokens or [None] * rows)
    grammar_errors: dict[int, GrammarError] = {}
    if matchers is not None:
        if processed is logits:  # the mask must not reach the logprobs, read from ``logits``
            processed = logits.clone()
        grammar_errors = apply_masks(processed, matchers)
    greedy = [p.greedy for p in params]
    chosen = processed.argmax(dim=-1)
    if not all(greedy):
        dev, f32 = logits.device, logits.dtype  # the logits' device: a GPU's stay there
        temps = to_device([1.0 if p.greedy else p.temperature for p in params], f32, dev)
        top_k = to_device([min(p.top_k, vocab) for p in params], torch.int64, dev)
        top_p = to_device([p.top_p for p in params], f32, dev)
        min_p = to_device([p.min_p for p in params], f32, dev)
        scaled = processed / temps.unsqueeze(-1)
        probs = _truncate(scaled, top_k, top_p, min_p).softmax(dim=-1)
        free = [i for i in range(rows) if not greedy[i] and generators[i] is None]
        if free:
            index = to_device(free, torch.int64, dev)
            chosen[index] = _free_draw(probs[index])
        for i in range(rows):
            if not greedy[i] and (gen := generators[i]) is not None:
                chosen[i] = _seeded_draw(probs[i], gen)
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not asked:
        return DeviceDraws(chosen, [], [], start_host_copy(chosen), grammar_errors=grammar_errors)
    # Logprobs (the model's own, before processing): one gather and one top-k over the rows
    # that asked.
    rows_asked = to_device(asked, torch.int64, logits.device)
    log_probs = logits[rows_asked].log_softmax(dim=-1)
    chosen_lp = log_probs.gather(1, chosen[rows_asked].unsqueeze(1)).squeeze(1)
    widths = [params[i].logprobs or 0 for i in asked]
    values, ids = log_probs.topk(max(max(widths), 1), dim=-1)
    host = start_host_copy(chosen, chosen_lp, values, ids)
    return DeviceDraws(chosen, asked, widths, host, chosen_lp, values, ids, grammar_errors)


def _free_draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` from the global RNG: ``multinomial`` on the CPU (the
    tokens pagedkv has always drawn); on a GPU the exponential race (argmax of p / E, E ~
    Exp(1): the same distribution, vLLM's way), whose kernels check nothing on the host."""
    if probs.device.type == "cpu":
        return torch.multinomial(probs, 1).squeeze(1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def _seeded_draw(row: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token from ``row``'s probabilities with ``gen``: on the CPU ``multinomial`` (the
    tokens pagedkv has always drawn); on a device generator the exponential race (argmax of
    p / E, E ~ Exp(1): the same distribution, and no host sync)."""
    if gen.device.type == "cpu":
        return torch.multinomial(row.cpu(), 1, generator=gen)[0]
    race = torch.empty_like(row).exponential_(generator=gen)
    return (row / race).argmax()


def to_host(d: DeviceDraws) -> SampleResult:
    """The draws on the host: the step's one wait, for the copy of the sampled ids (and
    logprobs' own) that ``draw`` queued."""
    ids_host, *lp_host = d.host.wait()  # (the ids, then logprobs' three when asked)
    assert ids_host is not None
    token_ids = ids_host.cpu().tolist()
    rows = len(token_ids)
    logprobs: list[float | None] = [None] * rows
    top: list[list[tuple[int, float]] | None] = [None] * rows
    if d.asked:
        assert len(lp_host) == 3 and all(t is not None for t in lp_host)
        chosen, values, ids = (t.cpu().tolist() for t in lp_host if t is not None)
        for j, i in enumerate(d.asked):
            logprobs[i] = chosen[j]
            if w := d.widths[j]:
                top[i] = list(zip(ids[j][:w], values[j][:w], strict=True))
    return SampleResult(token_ids, logprobs, top)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    tokens: list[RowTokens | None] | None = None,
    matchers: list[Any | None] | None = None,
) -> SampleResult:
    """``draw``, then ``to_host``: one token per row (see ``draw``)."""
    return to_host(draw(logits, params, generators, tokens, matchers))


_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive seeds apart before mixing in the position


def seeded_generator(
    seed: int | None, position: int, device: torch.device | None = None
) -> torch.Generator | None:
    """The generator for output token ``position`` of a sample seeded ``seed`` (None: use the
    global RNG), on ``device`` (a GPU's draws stay there; default the CPU). Stateless: the draw
    depends only on (seed, position), so a sample's tokens do not depend on batching,
    preemption, forking or whether the engine schedules ahead."""
    if seed is None:
        return None
    gen = torch.Generator(device=device or torch.device("cpu"))
    gen.manual_seed((seed * _GOLDEN + position) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen
