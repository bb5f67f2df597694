"""``Seq``: one stream of tokens the scheduler moves through waiting → running → finished
(running ⇄ swapped while swap preemption parks its KV in host memory).

A request with ``n > 1`` samples becomes one parent sequence plus ``n - 1`` children forked from
it once the prompt is computed; all of them carry the request's ``request_id``. Everything else
about a sequence (is it prefilling? how many tokens are left?) is derived from its counters, not
stored as extra statuses.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from pagedkv.kvcache.hashing import NO_EXTRA_KEYS, HashExtraKeys
from pagedkv.kvcache.protocol import MAX_PLACEHOLDERS

# Token ids are kept as unsigned 32-bit ints: 4 bytes a token, which matters for a simulator
# that holds thousands of 10k-token prompts, and it is the layout the block hashes read.
TOKEN_TYPECODE = "I"
# The id of a token scheduled one step ahead (an asynchronous engine computes a sequence's next
# token while its value is still being sampled): one of the last ``MAX_PLACEHOLDERS`` of
# ``token_ids`` (the contract, ``kvcache/protocol.py``) until ``update`` writes the sampled id
# over it. No vocabulary reaches 2^32 - 1.
PLACEHOLDER = 0xFFFFFFFF


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV waits in the host swap space
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a sequence finished (values follow the OpenAI ``finish_reason`` words)."""

    STOP = "stop"  # sampled EOS or a stop token
    LENGTH = "length"  # reached max_new_tokens or max_model_len
    ABORT = "abort"  # the caller aborted the request
    REFUSED = "refused"  # can never fit the pool or the context; see ``finish_detail``


class Seq:
    """Token ids and progress of one sequence. Satisfies ``kvcache.protocol.SeqLike``.

    The scheduler owns ``status``, ``num_computed_tokens`` and the finish fields; callers read
    them. ``token_ids`` is the prompt followed by the generated tokens; the allocator reads it
    and the scheduler appends to it (``append_token``), so callers must not mutate it.
    """

    __slots__ = (
        "seq_id",
        "request_id",
        "arrival_time_s",
        "max_new_tokens",
        "stop_token_ids",
        "extra_keys",
        "num_samples",
        "scores_prompt",
        "parent",
        "status",
        "finish_reason",
        "finish_detail",
        "num_computed_tokens",
        "num_preemptions",
        "max_computed_tokens",
        "_token_ids",
        "_num_prompt_tokens",
        "_num_placeholders",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: Iterable[int],
        max_new_tokens: int,
        *,
        arrival_time_s: float = 0.0,
        stop_token_ids: Iterable[int] = (),
        extra_keys: HashExtraKeys = NO_EXTRA_KEYS,
        num_samples: int = 1,
        scores_prompt: bool = False,
    ) -> None:
        """``stop_token_ids`` should include EOS unless the caller wants it ignored.
        ``num_samples`` (``n``) > 1 makes this the parent of ``n - 1`` forks. ``scores_prompt``:
        the engine needs the logits of every prompt position (prompt logprobs), so the
        scheduler admits it without a prefix-cache hit (a reused block has no logits)."""
        self._token_ids = array(TOKEN_TYPECODE, prompt_token_ids)
        if not self._token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        if max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1")
        if num_samples < 1:
            raise ValueError(f"request {request_id!r}: n must be >= 1")
        self.seq_id = seq_id
        self.request_id = request_id
        self.arrival_time_s = arrival_time_s
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.extra_keys = extra_keys
        self.num_samples = num_samples
        self.scores_prompt = scores_prompt
        self.parent: Seq | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.finish_detail = ""
        self.num_computed_tokens = 0  # tokens whose KV is written (or reused from the cache)
        self.num_preemptions = 0
        # High-water mark of computed tokens: what a recompute after preemption redoes.
        self.max_computed_tokens = 0
        self._num_prompt_tokens = len(self._token_ids)
        # The last tokens, scheduled ahead (``PLACEHOLDER``): 0, 1 or 2 of them.
        self._num_placeholders = 0

    # -- SeqLike ---------------------------------------------------------------------------

    @property
    def token_ids(self) -> SequenceABC[int]:
        return self._token_ids

    @property
    def num_known_tokens(self) -> int:
        """``token_ids[:num_known_tokens]`` are known; the rest (at most ``MAX_PLACEHOLDERS``)
        are placeholders of tokens scheduled ahead (allocators hash known tokens only)."""
        return len(self._token_ids) - self._num_placeholders

    @property
    def cache_salt(self) -> str | None:
        """The salt that keeps this sequence's KV from being shared with unsalted requests."""
        return self.extra_keys.cache_salt

    # -- derived facts ---------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self._num_prompt_tokens

    @property
    def prompt_token_ids(self) -> SequenceABC[int]:
        return self._token_ids[: self._num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens known so far (placeholders scheduled ahead left out)."""
        return self._token_ids[self._num_prompt_tokens : self.num_known_tokens].tolist()

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_known_tokens - self._num_prompt_tokens

    @property
    def has_placeholder(self) -> bool:
        return self._num_placeholders > 0

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not written yet (1 while decoding, more while prefilling)."""
        return len(self._token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence may hold at most: prompt plus every allowed new token."""
        return self._num_prompt_tokens + self.max_new_tokens

    def samples_after(self, num_new_tokens: int) -> int:
        """Tokens to sample once ``num_new_tokens`` more are computed: 0 if that does not reach
        the last known token (no logits needed), ``num_samples`` for the first output token
        (``n > 1`` forks from it), else 1."""
        if self.num_computed_tokens + num_new_tokens < len(self._token_ids):
            return 0
        return self.num_samples if len(self._token_ids) == self._num_prompt_tokens else 1

    def stop_reason(self) -> FinishReason | None:
        """Why this sequence stops after its last known token, or None if it goes on."""
        known = self.num_known_tokens
        outputs = known - self._num_prompt_tokens
        if outputs and self._token_ids[known - 1] in self.stop_token_ids:
            return FinishReason.STOP
        if outputs >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    # -- mutation (scheduler only) ----------------------------------------------------------

    def append_token(self, token_id: int) -> None:
        """The next sampled token: written over the oldest placeholder, if any."""
        if self._num_placeholders:
            self._token_ids[len(self._token_ids) - self._num_placeholders] = token_id
            self._num_placeholders -= 1
        else:
            self._token_ids.append(token_id)

    def drop_placeholders(self) -> None:
        """Forget the tokens scheduled ahead (the sequence ended before they were drawn)."""
        if self._num_placeholders:
            del self._token_ids[-self._num_placeholders :]
            self._num_placeholders = 0

    def append_placeholder(self) -> None:
        """Schedule the next token before its value is known (``PLACEHOLDER``)."""
        if self._num_placeholders >= MAX_PLACEHOLDERS:
            raise ValueError(f"sequence {self.seq_id}: {MAX_PLACEHOLDERS} tokens ahead already")
        self._token_ids.append(PLACEHOLDER)
        self._num_placeholders += 1

    def fork(self, seq_id: int) -> Seq:
        """A child holding the same tokens and progress, waiting to be admitted by the
        scheduler (which calls ``allocator.fork``). The child samples once (``n = 1``)."""
        if self._num_placeholders:
            raise ValueError(f"sequence {self.seq_id}: no fork while a token is scheduled ahead")
        child = Seq(
            seq_id,
            self.request_id,
            self._token_ids,
            self.max_new_tokens,
            arrival_time_s=self.arrival_time_s,
            stop_token_ids=self.stop_token_ids,
            extra_keys=self.extra_keys,
        )
        child._num_prompt_tokens = self._num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.max_computed_tokens = self.max_computed_tokens
        child.parent = self
        return child

    def __repr__(self) -> str:
        return (
            f"Seq(id={self.seq_id}, request={self.request_id!r}, {self.status.value}, "
            f"tokens={self.num_tokens} (prompt {self._num_prompt_tokens}), "
            f"computed={self.num_computed_tokens})"
        )
