"""``LLMEngine``: a real model on the paged KV cache, with continuous batching.

One ``step()`` = ``scheduler.schedule()`` -> ``runner.execute()`` (copy-on-write copies, then the
forward pass over every scheduled sequence's new tokens) -> sampling -> ``scheduler.update()``.
The scheduler and the allocators are the same objects the simulator drives.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator, Sequence

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.requests import RequestState
from pagedkv.engine.sampler import sample, seeded_generator
from pagedkv.engine.startup import EngineParts, build_parts
from pagedkv.engine.stats import EngineStats, StatsRecorder
from pagedkv.kvcache.hashing import HashExtraKeys
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sched.sequence import Sequence as Seq


class LLMEngine:
    """Not thread-safe: one caller (or the server's engine loop) drives ``step``."""

    def __init__(self, config: EngineConfig | None = None, parts: EngineParts | None = None):
        """Load the model and build the KV pool, allocator and scheduler. ``parts`` injects an
        already loaded model (tests, benchmarks) instead of ``config.model``."""
        self.config = config or EngineConfig()
        self.parts = parts or build_parts(self.config)
        p = self.parts
        self.tokenizer, self.allocator, self.scheduler, self.runner = (
            p.tokenizer,
            p.allocator,
            p.scheduler,
            p.runner,
        )
        if self.config.log_startup:
            print(p.startup_report, file=sys.stderr)
        self._requests: dict[str, RequestState] = {}
        self._seq_owner: dict[int, RequestState] = {}
        self._ids = itertools.count()
        # Outputs of other requests that generate() / stream() stepped past, newest per request:
        # handed to the next step() caller instead of being lost.
        self._stash: dict[str, RequestOutput] = {}
        self.recorder = StatsRecorder(self.allocator)

    @property
    def max_model_len(self) -> int:
        return self.parts.max_model_len

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request (text, or token ids); returns its id. ValueError for an empty prompt,
        a prompt that cannot fit the context, or a duplicate id: nothing is queued then. A
        request that fits the context but never the KV pool finishes as "refused"."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.parts.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the context of {self.max_model_len} tokens"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.tokenizer.stop_token_ids
        seq = self.scheduler.add_request(
            request_id,
            token_ids,
            params.max_tokens,
            stop_token_ids=stops,
            extra_keys=HashExtraKeys(cache_salt=cache_salt),
            n=params.n,
        )
        state = RequestState(request_id, text, token_ids, params, self.tokenizer)
        state.attach(seq, sample_index=0)
        self._requests[request_id] = state
        self._seq_owner[seq.seq_id] = state
        if seq.is_finished:  # refused at once: it can never fit the KV pool
            state.refuse(seq.finish_detail)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        state = self._requests.get(request_id)
        if state is None or state.finished:
            return False
        self.scheduler.abort(request_id)
        state.mark_aborted()
        self._forget(state)
        return True

    def has_unfinished(self) -> bool:
        """Whether a request is still running or waits to report (a refusal is reported by the
        next ``step``)."""
        return self.scheduler.has_unfinished() or bool(self._requests) or bool(self._stash)

    # -- one step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests whose state changed (finished ones for
        the last time: the engine forgets them afterwards)."""
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        touched = {self._seq_owner[s.seq_id].request_id for s in batch.refused}
        for seq in batch.refused:
            self._seq_owner[seq.seq_id].refuse(seq.finish_detail)
        logits = self.runner.execute(batch, self.allocator)
        self.recorder.record_step(batch, started)  # before update() frees finished sequences
        sampled = self._sample(batch, logits)
        for item in batch.seqs:
            self._seq_owner[item.seq.seq_id].note_admission(item.seq, item.prefix_hit_tokens)
        finished = self.scheduler.update(batch, [s[0] for s in sampled])
        self._adopt_children(batch, finished)
        for item, (tokens, logprobs) in zip(batch.seqs, sampled, strict=True):
            if not tokens:
                continue
            state = self._seq_owner[item.seq.seq_id]
            touched.add(state.request_id)
            # Draw j of this row is sample index(seq) + j: the children of an n > 1 request.
            first = state.sample_index(item.seq)
            for j, logprob in enumerate(logprobs):
                seq = item.seq if j == 0 else state.seq_of(first + j)
                if seq is not None and state.record(seq, logprob):  # a stop string matched
                    self.scheduler.finish_sequence(seq)
        self.recorder.end_step()
        outputs, self._stash = list(self._stash.values()), {}
        for request_id in touched:
            state = self._requests[request_id]
            outputs.append(state.snapshot())
            if state.finished:
                self._forget(state)
        return outputs

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor):
        """One (token ids, logprob info) pair per batch entry; n draws for a request's first
        token when it has n samples, each from its own seed."""
        rows, params, gens, owners = [], [], [], []
        r = 0
        for i, item in enumerate(batch.seqs):
            if not item.needs_logits:
                continue
            state = self._seq_owner[item.seq.seq_id]
            first = state.sample_index(item.seq)
            position = item.seq.num_output_tokens
            for j in range(item.num_samples):
                rows.append(r)
                params.append(state.params)
                gens.append(seeded_generator(state.params.sample_seed(first + j), position))
                owners.append(i)
            r += 1
        out: list[tuple[list[int], list]] = [([], []) for _ in batch.seqs]
        if rows:
            result = sample(logits[torch.tensor(rows)], params, gens)
            for k, i in enumerate(owners):
                out[i][0].append(result.token_ids[k])
                out[i][1].append((result.logprobs[k], result.top_logprobs[k]))
        return out

    def _adopt_children(self, batch: ScheduledBatch, finished: list[Seq]) -> None:
        """Give the children forked for n > 1 their request and sample index (by creation
        order, which is the order of the parent's draws)."""
        if not any(item.num_samples > 1 for item in batch.seqs):
            return
        pool = itertools.chain(finished, self.scheduler.running, self.scheduler.waiting)
        children = sorted(
            (s for s in pool if s.parent is not None and s.seq_id not in self._seq_owner),
            key=lambda s: s.seq_id,
        )
        for child in children:
            state = self._seq_owner[child.parent.seq_id]
            state.attach(child, sample_index=state.num_attached)
            self._seq_owner[child.seq_id] = state

    def _forget(self, state: RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for seq_id in state.seq_ids:
            self._seq_owner.pop(seq_id, None)

    # -- conveniences ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in prompt order. A prompt that is
        invalid (empty, too long) gets an output with ``error`` set; the others still run.
        Requests added elsewhere advance too; their outputs wait for the next ``step()``."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, plist, strict=True):
            request_id = f"gen-{next(self._ids)}"
            order.append(request_id)
            try:
                self.add_request(prompt, p, request_id)
            except ValueError as exc:
                ids = [] if isinstance(prompt, str) else list(prompt)
                text = prompt if isinstance(prompt, str) else None
                n = (p or SamplingParams()).n
                outs = [CompletionOutput(i, finish_reason="error") for i in range(n)]
                results[request_id] = RequestOutput(request_id, text, ids, outs, error=str(exc))
        mine = set(order)
        while len(results) < len(order):
            for out in self.step():
                if out.request_id not in mine:
                    self._stash[out.request_id] = out
                elif out.finished:
                    results[out.request_id] = out
        return [results[r] for r in order]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[tuple[str, RequestOutput]]:
        """Run one request (other queued requests advance too, and their outputs wait for the
        next ``step()``); yields (new text of sample 0, the request's output) after every step
        that changed it."""
        request_id = self.add_request(prompt, params)
        printed = 0
        while True:
            for out in self.step():
                if out.request_id != request_id:
                    self._stash[out.request_id] = out
                    continue
                text = out.outputs[0].text
                yield text[printed:], out
                printed = len(text)
                if out.finished:
                    return

    def stats(self) -> EngineStats:
        return self.recorder.summary(self.scheduler)
