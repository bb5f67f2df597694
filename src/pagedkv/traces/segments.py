"""A request of a trace, and the token ids its prompt stands for.

A prompt is a tuple of *segments* ``(segment_id, num_tokens)``; the tokens of a segment depend
only on its id (``segment_tokens``: segment ``s`` holds ``s * 512 + 1``, ``s * 512 + 2``, ...), so
two requests share exactly the leading segments they have in common, and a block-granular prefix
cache of any block size sees exactly that many shared tokens. Mooncake's ``hash_ids`` are such
segments (512-token prefix blocks, the last one cut to the prompt length). Text no trace names
gets *fresh* segments: one segment per piece of text, however long, which reserves
``ceil(n / 512)`` consecutive ids (at most ``MAX_RESERVED_SEGMENTS``), so that each fresh
segment starts with tokens no other segment holds. A
long prompt therefore costs O(1) until ``segment_tokens`` materializes it, which the simulator
does only for requests the scheduler can run.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from pagedkv.errors import UsageError

SEGMENT_TOKENS = 512  # Mooncake's hash block size: the id stride of segment token ranges
# Segment ids a trace does not name are drawn from here up, above Mooncake's ids.
FRESH_SEGMENT_BASE = 4_000_000
_TOKEN_ID_LIMIT = 2**32  # segment tokens live in array("I")
# A fresh segment reserves at most this many segment ids (2 Mi tokens). A longer one's tail may
# reuse ids of the fresh segments after it, which cannot fake a prefix hit: a hit needs the same
# tokens from a sequence's start, and every fresh segment begins with a token of its own. Without
# the cap, two 10^9-token prompts (refused anyway) would use up the 32-bit id space for the rest.
MAX_RESERVED_SEGMENTS = 4096

Segments = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. ``prompt`` and ``output`` are segment lists; ``output`` is empty
    unless the trace knows the generated tokens (then later prompts may reuse them).
    ``output_len_tokens`` is what the trace says (it may be 0: an engine still samples one
    token, which is the simulator's business, not the trace's)."""

    arrival_time_s: float
    prompt: Segments
    output_len_tokens: int
    output: Segments = ()

    @property
    def prompt_len_tokens(self) -> int:
        return sum(n for _, n in self.prompt)


def segment_tokens(segments: Segments) -> array:
    """The token ids of ``segments`` (never 0). UsageError if an id would not fit 32 bits
    (a trace of more than about 2 * 10^9 distinct tokens)."""
    out = array("I")
    for seg_id, n in segments:
        base = seg_id * SEGMENT_TOKENS + 1
        if base + n > _TOKEN_ID_LIMIT:
            raise UsageError("the trace holds too many distinct tokens for 32-bit token ids")
        out.extend(range(base, base + n))
    return out


class FreshSegments:
    """Hands out segments no trace uses (deterministic: a counter)."""

    def __init__(self, start: int = FRESH_SEGMENT_BASE) -> None:
        self.next_id = start

    def take(self, num_tokens: int) -> Segments:
        """One fresh segment of ``num_tokens`` (empty for 0), in O(1) for any length."""
        if num_tokens <= 0:
            return ()
        seg_id = self.next_id
        self.next_id += min(-(-num_tokens // SEGMENT_TOKENS), MAX_RESERVED_SEGMENTS)
        return ((seg_id, num_tokens),)
