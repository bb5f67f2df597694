"""``RequestState``: the engine's view of one request across its samples (n >= 1).

Text has one owner per sample: a ``Detokenizer`` that turns each new token into released text,
holding back an incomplete UTF-8 character or what could still become a stop string, so that
text once reported is never taken back. The server streams exactly what this exposes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagedkv.engine.detokenizer import Detokenizer
from pagedkv.engine.outputs import CompletionOutput, PromptTokenScore, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.sched.batch import ScheduledSeq
from pagedkv.sched.sequence import Seq

# Logprob info of one sampled token: (chosen logprob or None, top alternatives or None).
TokenLogprob = tuple[float | None, list[tuple[int, float]] | None]


class RequestState:
    """Completions, detokenisers and the sequence <-> sample index maps of one request."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        matchers: list[Any] | None = None,
    ) -> None:
        """``matchers``: one grammar matcher per sample (``params.structured``), else None."""
        self.request_id = request_id
        self.matchers = matchers
        self.params = params
        self.num_cached_tokens = 0
        self.num_partial_cached_tokens = 0  # of num_cached_tokens, from a partial block
        self.num_prefix_copied_tokens = 0  # of those, copied (not claimed in place)
        self._admitted = False
        self._index: dict[int, int] = {}  # seq id -> sample index
        self._seqs: dict[int, Seq] = {}  # sample index -> its sequence
        self._detok = [Detokenizer(tokenizer, params.stop) for _ in range(params.n)]
        outs = [CompletionOutput(i) for i in range(params.n)]
        if params.logprobs is not None:
            for o in outs:
                o.logprobs, o.top_logprobs = [], []
        self._output = RequestOutput(request_id, prompt, list(prompt_token_ids), outs)
        if params.prompt_logprobs is not None:
            self._output.prompt_logprobs = [None] * len(prompt_token_ids)

    # -- sequences -------------------------------------------------------------------------

    def attach(self, seq: Seq, sample_index: int) -> None:
        self._index[seq.seq_id] = sample_index
        self._seqs[sample_index] = seq

    @property
    def seq_ids(self) -> list[int]:
        return list(self._index)

    def sample_index(self, seq: Seq) -> int:
        return self._index[seq.seq_id]

    def seq_of(self, sample_index: int) -> Seq | None:
        return self._seqs.get(sample_index)

    # -- progress --------------------------------------------------------------------------

    def note_admission(
        self, seq: Seq, prefix_hit_tokens: int, partial_tokens: int = 0, copied_tokens: int = 0
    ) -> None:
        """Record the prompt's prefix hit (``partial_tokens`` of it from a partially matched
        block, ``copied_tokens`` of those copied) at the request's first admission only: a
        re-admission after preemption, or a child recomputed after a failed fork, also hits
        its own blocks."""
        if not self._admitted and self._index.get(seq.seq_id) == 0:
            self._admitted = True
            self.num_cached_tokens = prefix_hit_tokens
            self.num_partial_cached_tokens = partial_tokens
            self.num_prefix_copied_tokens = copied_tokens

    def record_prompt(self, first_token: int, scores: list[PromptTokenScore]) -> None:
        """Prompt tokens ``first_token, ...`` scored by the prefill (again, identically, when a
        preempted request is recomputed)."""
        scored = self._output.prompt_logprobs
        if scored is not None:
            scored[first_token : first_token + len(scores)] = scores

    def record_token(
        self, sample_index: int, token_id: int, logprob: TokenLogprob, complete: bool = False
    ) -> bool:
        """Take sample ``sample_index``'s new token (before the scheduler appends it);
        ``complete``: it closed the sample's grammar. Returns True when a stop string or the
        grammar ended the sample just now: the caller tells the scheduler."""
        out = self._output.outputs[sample_index]
        if out.finished:
            return False
        out.token_ids.append(token_id)
        if out.logprobs is not None and out.top_logprobs is not None:
            out.logprobs.append(logprob[0])
            out.top_logprobs.append(logprob[1] or [])
        detok = self._detok[sample_index]
        out.text += detok.push(token_id)  # the delta: flat cost per token
        if detok.stopped or complete:
            if complete:
                out.text += detok.flush()  # no stop string can come after the structure
            out.finish_reason = "stop"
            return True
        return False

    def finish_sample(self, seq: Seq) -> None:
        """The scheduler finished ``seq`` (stop token, length, stop string): release the text
        held back for a stop string that can no longer come, and record why it ended."""
        i = self._index[seq.seq_id]
        out = self._output.outputs[i]
        if out.finish_reason is None and seq.finish_reason is not None:
            out.text += self._detok[i].flush()
            out.finish_reason = seq.finish_reason.value

    def refuse(self, detail: str) -> None:
        self._end("refused", detail)

    def fail(self, detail: str, param: str | None = None) -> None:
        """A failure inside a step hit this request: it ends with ``error`` set (and
        ``error_param``, the field it is traced to, if any)."""
        self._output.error_param = param
        self._end("error", detail)

    def mark_aborted(self) -> None:
        self._end("abort", None)

    def _end(self, reason: str, detail: str | None) -> None:
        if detail is not None:
            self._output.error = detail
        for o in self._output.outputs:
            o.finish_reason = o.finish_reason or reason

    @property
    def finished(self) -> bool:
        return self._output.finished

    def snapshot(self) -> RequestOutput:
        """A copy the caller may keep (lists copied, not deep-copied: ints and floats)."""
        outs = [
            replace(
                o,
                token_ids=list(o.token_ids),
                logprobs=None if o.logprobs is None else list(o.logprobs),
                top_logprobs=None if o.top_logprobs is None else list(o.top_logprobs),
            )
            for o in self._output.outputs
        ]
        scored = self._output.prompt_logprobs
        return replace(
            self._output,
            outputs=outs,
            num_cached_tokens=self.num_cached_tokens,
            num_partial_cached_tokens=self.num_partial_cached_tokens,
            num_prefix_copied_tokens=self.num_prefix_copied_tokens,
            prompt_token_ids=list(self._output.prompt_token_ids),
            prompt_logprobs=None if scored is None else list(scored),
        )


def partial_hit(
    item: ScheduledSeq, allocator: KVAllocator, block_size: int, copied: dict[int, int]
) -> tuple[int, int]:
    """``(tokens of item's prefix hit from a partially matched block, of those copied)``; a
    hit's whole blocks are a multiple of the block size, a partial block's tokens the rest.
    ``copied``: the step's prefix copies, destination block -> tokens (a block claimed in
    place is none of them: 0 copied)."""
    partial = item.prefix_hit_tokens % block_size
    if not partial or not allocator.has_seq(item.seq):
        return partial, 0
    block = allocator.block_table(item.seq)[item.prefix_hit_tokens // block_size]
    return partial, copied.get(block, 0)
