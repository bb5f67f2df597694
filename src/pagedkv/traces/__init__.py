"""Request traces: the one reader of trace files, the synthetic generator, and the prefix rule.

At the bottom of the import graph (it imports only ``pagedkv.errors``): ``pagedkv plan
--trace`` and ``pagedkv simulate --trace`` read the same requests through ``load_trace`` and
judge prefix reuse by the same rule (``prefix``), so the two commands cannot disagree on a file.

    requests = load_trace("mooncake_conversation.jsonl", max_requests=2000)
    reusable_prefix_tokens(requests)     # per request: tokens a prefix cache can reuse
    shared_trace("azure_llm_2023_conv.csv")  # the real traces beside the checkout, or None
"""

from pagedkv.traces.prefix import (
    ideal_prefix_hit_tokens,
    reusable_prefix_tokens,
    shared_prefix_tokens,
)
from pagedkv.traces.readers import BadLineHandler, load_trace, rescale, skipped_lines_note
from pagedkv.traces.segments import (
    SEGMENT_TOKENS,
    FreshSegments,
    Segments,
    TraceRequest,
    segment_tokens,
)
from pagedkv.traces.shared import (
    require_shared_trace,
    shared_trace,
    shared_traces_candidates,
    shared_traces_dir,
)
from pagedkv.traces.synthetic import LengthDist, SyntheticSpec, generate, parse_spec

__all__ = [
    "SEGMENT_TOKENS",
    "BadLineHandler",
    "FreshSegments",
    "LengthDist",
    "Segments",
    "SyntheticSpec",
    "TraceRequest",
    "generate",
    "ideal_prefix_hit_tokens",
    "load_trace",
    "parse_spec",
    "rescale",
    "require_shared_trace",
    "reusable_prefix_tokens",
    "segment_tokens",
    "shared_prefix_tokens",
    "shared_trace",
    "shared_traces_candidates",
    "shared_traces_dir",
    "skipped_lines_note",
]
