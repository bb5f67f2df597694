"""What prefix a request of a trace can hit: the one rule that ``plan`` and ``simulate`` share.

**The rule.** A request's *shared* prefix is the run of its leading segments that some earlier
request's prompt (followed by that request's known answer, if the trace has one) also started
with, segment by segment, position by position. Where the run ends on a segment id both hold
but with different lengths, the match counts the shorter of the two: a segment's tokens are a
prefix of the same id's longer version. For Mooncake this means a request reuses at most the
tokens that its own ``hash_ids`` cover *and* that an earlier request with the same ids held:
a 1,000-token request after a 700-token one with the same two ids shares 700 tokens (the earlier
one held only 188 tokens of the second block), never 1,000.

The *reusable* prefix is the shared prefix capped at ``prompt - 1`` tokens: the engine always
computes the last prompt token (its logits give the first output token), so even a prompt seen
before in full reuses one token less. ``pagedkv plan --trace`` prices exactly these lengths as
its P distribution, and a never-evicting cache of ``B``-token blocks reuses each one rounded
down to whole blocks (``ideal_prefix_hit_tokens``: what ``simulate`` reports as the ideal).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.traces.segments import TraceRequest
from pagedkv.units import check_block_size


def shared_prefix_tokens(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request (in the given order): its shared prefix length in tokens (see above)."""
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


def reusable_prefix_tokens(
    requests: Sequence[TraceRequest], shared: Sequence[int] | None = None
) -> list[int]:
    """Per request: the shared prefix capped at ``prompt - 1`` tokens (see above)."""
    shared = shared_prefix_tokens(requests) if shared is None else shared
    return [
        max(0, min(s, req.prompt_len_tokens - 1)) for req, s in zip(requests, shared, strict=True)
    ]


def ideal_prefix_hit_tokens(
    requests: Sequence[TraceRequest], block_size: int, reusable: Sequence[int] | None = None
) -> int:
    """Tokens a never-evicting cache of ``block_size``-token blocks reuses over ``requests``
    admitted in order: each reusable prefix rounded down to whole blocks."""
    check_block_size(block_size)
    reusable = reusable_prefix_tokens(requests) if reusable is None else reusable
    return sum(r - r % block_size for r in reusable)
