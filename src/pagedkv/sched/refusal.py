"""The refusal rule: a request that can never run to completion is finished at once.

Retrying such a request would never succeed (and, at the head of a first-come-first-served
queue, would block everyone behind it), so the scheduler refuses it when it is added.
"""

from __future__ import annotations

from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.sched.sequence import Sequence


def never_fits(
    seq: Sequence,
    allocator: KVAllocator,
    max_model_len: int | None,
    max_num_batched_tokens: int | None,
) -> str:
    """Why ``seq`` can never finish, or "" if it can: prompt + ``max_new_tokens`` beyond
    ``max_model_len`` or beyond the whole pool; or, when ``max_num_batched_tokens`` is given
    (chunked prefill off), a prompt that no single step can hold."""
    total = seq.max_total_tokens
    if max_model_len is not None and total > max_model_len:
        return (
            f"prompt ({seq.num_prompt_tokens}) + max_new_tokens ({seq.max_new_tokens}) "
            f"= {total} tokens exceeds max_model_len {max_model_len}"
        )
    block_size = allocator.block_size
    if -(-total // block_size) > allocator.num_total_blocks:
        pool_tokens = allocator.num_total_blocks * block_size
        return f"{total} tokens exceed the whole KV pool ({pool_tokens} tokens)"
    if max_num_batched_tokens is not None and seq.num_prompt_tokens > max_num_batched_tokens:
        return (
            f"prompt ({seq.num_prompt_tokens}) exceeds max_num_batched_tokens "
            f"({max_num_batched_tokens}) and chunked prefill is off"
        )
    return ""
