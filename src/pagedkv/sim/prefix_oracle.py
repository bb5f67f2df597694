"""What prefix reuse a trace allows: the yardstick for the allocators' prefix-hit counts.

For each request, the longest token prefix it shares with any earlier request's prompt (or
known answer), as the segment ids say. A cache that never evicts, admitting requests in arrival
order, can reuse exactly that much, rounded down to whole blocks and never the last prompt
token (which must be computed for logits).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.sim.traces import TraceRequest


def shared_prefix_tokens(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request (in the given order): tokens of its prompt that an earlier request's prompt
    (followed by its known answer) already held, counted from the first token."""
    # A trie over (segment id, length): a path continues only through identical segments; the
    # longest length seen of a segment under a node bounds a partial match of the last one.
    children: dict[tuple[int, int, int], int] = {}
    longest: dict[tuple[int, int], int] = {}
    out: list[int] = []
    for req in requests:
        shared = 0
        parent = 0
        for seg_id, n in req.prompt:
            child = children.get((parent, seg_id, n))
            if child is None:
                shared += min(n, longest.get((parent, seg_id), 0))
                break
            shared += n
            parent = child
        out.append(shared)
        parent = 0
        for seg_id, n in (*req.prompt, *req.output):
            key = (parent, seg_id)
            longest[key] = max(longest.get(key, 0), n)
            parent = children.setdefault((parent, seg_id, n), len(children) + 1)
    return out


def ideal_prefix_hit_tokens(
    requests: Sequence[TraceRequest], block_size: int, shared: Sequence[int] | None = None
) -> int:
    """Tokens a never-evicting cache of ``block_size``-token blocks reuses over ``requests``:
    per request, the shared prefix capped at ``prompt - 1`` tokens, rounded down to blocks."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shared = shared_prefix_tokens(requests) if shared is None else shared
    total = 0
    for req, s in zip(requests, shared, strict=True):
        usable = min(s, req.prompt_len_tokens - 1)
        total += usable - usable % block_size
    return total
