"""The refusal rule: a request that can never run to completion is refused before it queues.

Retrying such a request would never succeed (and, at the head of a first-come-first-served
queue, would block everyone behind it). This is the only place that decides it: the scheduler
applies it when a request is added, and the engine's ``check_request`` (the server's 400s, the
CLI's errors) asks the same function, so every entry point answers the same.
"""

from __future__ import annotations

from typing import NamedTuple


class Refusal(NamedTuple):
    """Why a request can never finish: ``reason`` in words, ``param`` the request field to
    change, ``code`` the kind (``context_length_exceeded`` or ``kv_pool_too_small``)."""

    reason: str
    param: str
    code: str


def never_fits(
    num_prompt_tokens: int,
    max_new_tokens: int,
    num_samples: int,
    *,
    block_size: int,
    num_total_blocks: int,
    max_model_len: int | None,
    max_num_batched_tokens: int | None = None,
) -> Refusal | None:
    """Why a request can never finish, or None if it can.

    - prompt + ``max_new_tokens`` beyond ``max_model_len``;
    - its ``num_samples`` samples, each at its longest, not resident in the pool at once: they
      share the prompt's full blocks (copy-on-write) and each needs its own blocks after them;
    - when ``max_num_batched_tokens`` is given (chunked prefill off), a prompt that no single
      step can hold.
    """
    total = num_prompt_tokens + max_new_tokens
    if max_model_len is not None and total > max_model_len:
        return Refusal(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_new_tokens}) = {total} "
            f"tokens exceeds the context of {max_model_len} tokens",
            "max_tokens" if num_prompt_tokens < max_model_len else "prompt",
            "context_length_exceeded",
        )
    shared_blocks = num_prompt_tokens // block_size
    own_blocks = -(-total // block_size) - shared_blocks
    needed_blocks = shared_blocks + num_samples * own_blocks
    if needed_blocks > num_total_blocks:
        what = f"n = {num_samples} samples" if num_samples > 1 else "a request"
        return Refusal(
            f"{what} of up to {total} tokens need {needed_blocks} KV blocks of {block_size} "
            f"tokens at once; the whole KV pool has {num_total_blocks}",
            "n" if num_samples > 1 else "max_tokens",
            "kv_pool_too_small",
        )
    if max_num_batched_tokens is not None and num_prompt_tokens > max_num_batched_tokens:
        return Refusal(
            f"prompt ({num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
            f"({max_num_batched_tokens}) and chunked prefill is off",
            "prompt",
            "context_length_exceeded",
        )
    return None
