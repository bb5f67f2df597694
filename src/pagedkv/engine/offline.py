"""``OfflineCalls``: ``generate`` and ``stream``, the engine's calls for a caller that runs
requests to completion itself (scripts, benchmarks, the CLI), on top of ``LLMEngine``'s
``add_request`` / ``step`` / ``abort``. A mixin of ``LLMEngine`` (``_Engine`` names what it
uses), so the engine's own file holds the step and the requests' lifecycle only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import Prompt, pair_prompts, tokenize
from pagedkv.engine.registry import RequestRegistry
from pagedkv.errors import UsageError


class _Engine(Protocol):
    """What ``OfflineCalls`` reads of ``LLMEngine``."""

    tokenizer: Any
    _registry: RequestRegistry
    _stash: dict[str, RequestOutput]

    def _add(
        self,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
    ) -> str: ...

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...


class OfflineCalls:
    def generate(
        self: _Engine,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (a bare string or one list of ids is one) to completion, batched;
        outputs in prompt order. A prompt that can never run (empty, too long) gets an output
        with ``error`` set; a prompt of the wrong type raises ``UsageError`` before anything
        is queued. Others' requests advance too; their outputs wait for the next ``step()``."""
        pairs = pair_prompts(prompts, params)
        tokenized = [tokenize(self.tokenizer, p) for p, _ in pairs]  # raises before queueing
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for (text, ids), (_, p) in zip(tokenized, pairs, strict=True):
            request_id = self._registry.new_id("gen")
            order.append(request_id)
            try:
                self._add(text, ids, p, request_id, None)
            except UsageError as exc:
                n = p.n
                outs = [CompletionOutput(i, finish_reason="refused") for i in range(n)]
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
        self: _Engine, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[tuple[str, RequestOutput]]:
        """Run one request (other queued requests advance too, and their outputs wait for the
        next ``step()``); yields (new text of sample 0, the request's output) after every step
        that changed it. Ends after the final output, also when the request is aborted. A
        consumer that stops early (``break``, or closing the generator) aborts the request, so
        its blocks come back."""
        request_id = self.add_request(prompt, params)
        printed = 0
        try:
            while request_id in self._registry:  # gone without a final output: aborted
                mine = None
                for out in self.step():  # stash the others first: the consumer may stop here
                    if out.request_id == request_id:
                        mine = out
                    else:
                        self._stash[out.request_id] = out
                if mine is None:
                    continue
                text = mine.outputs[0].text
                yield text[printed:], mine
                printed = len(text)
                if mine.finished:
                    return
        finally:
            self.abort(request_id)  # no-op once it finished
