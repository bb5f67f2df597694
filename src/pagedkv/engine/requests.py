"""``RequestState``: the engine's view of one request across its samples (n >= 1)."""

from __future__ import annotations

from dataclasses import replace

from pagedkv.engine.outputs import CompletionOutput, RequestOutput, TextTracker
from pagedkv.engine.params import SamplingParams
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.sched.sequence import Sequence

# Logprob info of one sampled token: (chosen logprob or None, top alternatives or None).
TokenLogprob = tuple[float | None, list[tuple[int, float]] | None]


class RequestState:
    """Completions, text trackers and the sequence -> sample index map of one request."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.num_cached_tokens = 0
        self._admitted = False
        self._tokenizer = tokenizer
        self._index: dict[int, int] = {}  # seq id -> sample index
        self._seqs: dict[int, Sequence] = {}  # sample index -> its sequence
        self._trackers = [TextTracker(tokenizer, params.stop) for _ in range(params.n)]
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        outs = [CompletionOutput(i) for i in range(params.n)]
        if params.logprobs is not None:
            for o in outs:
                o.logprobs, o.top_logprobs = [], []
        self._output = RequestOutput(request_id, prompt, list(prompt_token_ids), outs)

    # -- sequences -------------------------------------------------------------------------

    def attach(self, seq: Sequence, sample_index: int) -> None:
        self._index[seq.seq_id] = sample_index
        self._seqs[sample_index] = seq

    @property
    def num_attached(self) -> int:
        return len(self._index)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._index)

    def sample_index(self, seq: Sequence) -> int:
        return self._index[seq.seq_id]

    def seq_of(self, sample_index: int) -> Sequence | None:
        return self._seqs.get(sample_index)

    # -- progress --------------------------------------------------------------------------

    def note_admission(self, seq: Sequence, prefix_hit_tokens: int) -> None:
        """Record the prompt's prefix hit at the request's first admission only: a re-admission
        after preemption, or a child recomputed after a failed fork, also hits its own blocks."""
        if not self._admitted and self._index.get(seq.seq_id) == 0:
            self._admitted = True
            self.num_cached_tokens = prefix_hit_tokens

    def record(self, seq: Sequence, logprob: TokenLogprob) -> bool:
        """Take ``seq``'s newest token (already appended by the scheduler). Returns True when a
        stop string ended it just now and the scheduler still runs it (the caller must finish
        it there)."""
        i = self._index[seq.seq_id]
        out = self._output.outputs[i]
        out.token_ids = seq.output_token_ids
        if out.logprobs is not None and out.top_logprobs is not None:
            out.logprobs.append(logprob[0])
            out.top_logprobs.append(logprob[1] or [])
        tracker = self._trackers[i]
        was_stopped = tracker.stopped
        tracker.update(out.token_ids)
        stopped_now = tracker.stopped and not was_stopped
        if stopped_now:
            out.finish_reason = "stop"
        elif seq.is_finished and seq.finish_reason is not None:
            out.finish_reason = seq.finish_reason.value
        # While running, hold back what could still turn out to be the start of a stop string,
        # so that text once reported is never taken back.
        out.text = tracker.text if out.finish_reason else tracker.text[: -self._holdback or None]
        return stopped_now and not seq.is_finished

    def refuse(self, detail: str) -> None:
        self._output.error = detail
        for o in self._output.outputs:
            o.finish_reason = o.finish_reason or "refused"

    def mark_aborted(self) -> None:
        for o in self._output.outputs:
            o.finish_reason = o.finish_reason or "abort"

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
        return replace(
            self._output,
            outputs=outs,
            num_cached_tokens=self.num_cached_tokens,
            prompt_token_ids=list(self._output.prompt_token_ids),
        )
