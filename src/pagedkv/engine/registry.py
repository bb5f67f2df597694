"""``RequestRegistry``: the engine's live requests, by request id and by sequence id.

One place knows which ``RequestState`` a sequence belongs to (its own, a forked child's, a
refused one's), hands out automatic ids that never collide with a caller's, and forgets a
request once its final output was reported. No torch here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.requests import RequestState
from pagedkv.sched.batch import Fork
from pagedkv.sched.sequence import Seq


class RequestRegistry:
    """Mutated by the engine only; ``by_id`` may be read, not changed, by others."""

    def __init__(self) -> None:
        self.by_id: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._ids = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def __len__(self) -> int:
        return len(self.by_id)

    def new_id(self, prefix: str) -> str:
        """A fresh automatic id, skipping any that a caller chose explicitly."""
        return next(r for r in (f"{prefix}-{i}" for i in self._ids) if r not in self.by_id)

    def add(self, state: RequestState, seq: Seq) -> None:
        """A new request and its first sequence (sample 0)."""
        state.attach(seq, sample_index=0)
        self.by_id[state.request_id] = state
        self._by_seq[seq.seq_id] = state

    def adopt(self, forks: Iterable[Fork]) -> None:
        """Each child forked for draw ``fork.sample_offset`` joins its parent's request."""
        for fork in forks:
            state = self._by_seq[fork.parent.seq_id]
            state.attach(fork.child, state.sample_index(fork.parent) + fork.sample_offset)
            self._by_seq[fork.child.seq_id] = state

    def owner(self, seq: Seq) -> RequestState:
        return self._by_seq[seq.seq_id]

    def find(self, seq: Seq) -> RequestState | None:
        """The owner, or None once the request was forgotten (failed or aborted mid-step)."""
        return self._by_seq.get(seq.seq_id)

    def forget(self, state: RequestState) -> None:
        self.by_id.pop(state.request_id, None)
        for seq_id in state.seq_ids:
            self._by_seq.pop(seq_id, None)

    def report(self, request_ids: set[str]) -> list[RequestOutput]:
        """Snapshots of these requests; the finished ones are forgotten (reported last time)."""
        outputs = []
        for request_id in request_ids:
            state = self.by_id.get(request_id)
            if state is None:
                continue
            outputs.append(state.snapshot())
            if state.finished:
                self.forget(state)
        return outputs
