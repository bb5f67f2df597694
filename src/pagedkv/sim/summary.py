"""One flat JSON-ready dict per run: the numbers the table, the JSON output and the README use.

Fields (times in simulated seconds unless the name says otherwise):

* ``policy``, ``allocator``, ``block_size``, ``prefix_caching``, ``num_kv_slots`` (pool tokens);
* ``num_requests``, ``num_finished``, ``refused`` (could never fit), ``prompt_tokens`` and
  ``output_tokens`` of the finished requests;
* ``prefix_hit_tokens`` (prompt tokens reused at first admission), ``prefix_hit_rate`` (of
  ``prompt_tokens``), ``ideal_prefix_hit_tokens`` (what the trace allows at this block size);
* ``duration_s`` (first arrival to last finish), ``num_steps``, ``throughput_tokens_per_s``
  (generated tokens / duration), ``total_tokens_per_s`` (prompt + generated);
* ``ttft_*_s``, ``tpot_*_s``, ``e2e_*_s`` at p50 / p90 / p99;
* ``peak_running``, ``mean_running`` (time-weighted), ``kv_utilization_mean`` and ``_peak`` (used
  slots / pool), the waste split as mean fractions of the pool: ``fragmentation_mean`` (unused
  slots in the tail blocks), ``reserved_unused_mean`` (reserved regions beyond what was
  stored), ``cached_mean`` (unreferenced blocks kept for prefix hits);
* ``normalized_latency_s_per_token``: the PagedAttention paper's metric, the mean over
  finished requests of end-to-end latency / output tokens;
* ``preemptions``, ``recomputed_tokens``, ``evictions``; swap preemption: ``swap_outs``,
  ``swap_ins`` (sequences), ``swapped_blocks_out`` / ``_in``, ``swap_fallbacks`` (victims
  recomputed because the swap space was full), ``swap_time_s`` (simulated transfer time);
  ``wall_time_s`` (real replay time);
* with a prefix match unit below the block size (partial-block reuse, ``kvcache/partial.py``)
  only: ``prefix_match_unit``, ``partial_hits`` (admissions whose hit ended inside a block),
  ``partial_hit_tokens`` (the tokens of those blocks; counted over every admission, so a
  preempted sequence re-admitted onto its own kept tail counts here and not in
  ``prefix_hit_tokens``, which counts first admissions), ``partial_claims``
  (blocks claimed in place), ``prefix_copy_bytes`` and ``prefix_copy_time_s`` (the other
  blocks' matched slots copied, and the simulated seconds that took on the clock).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pagedkv.sim.metrics import RequestRecord, percentile
from pagedkv.sim.simulator import RunResult
from pagedkv.traces import TraceRequest, ideal_prefix_hit_tokens


def ideal_hits(
    requests: Sequence[TraceRequest],
    records: Sequence[RequestRecord],
    block_size: int,
    reusable: Sequence[int] | None = None,
) -> int:
    """The hit ceiling of one never-evicting engine of ``block_size`` over the requests that
    were not refused (a refused request never entered a cache). ``reusable``: the trace's
    ``reusable_prefix_tokens``, reused when nothing was refused."""
    kept = [req for req, rec in zip(requests, records, strict=True) if not rec.refused]
    if len(kept) == len(requests):
        return ideal_prefix_hit_tokens(requests, block_size, reusable)
    return ideal_prefix_hit_tokens(kept, block_size)


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)


def summarize(result: RunResult, ideal_prefix_hit_tokens: int | None = None) -> dict[str, Any]:
    """The flat summary of ``result`` (see the module docstring for the fields)."""
    done = [r for r in result.records if r.finish_s is not None]
    out = _tokens(result, done, ideal_prefix_hit_tokens)
    out.update(_latencies(done))
    out.update(_pool(result))
    out.update(_partial_hits(result))
    return out


def _tokens(
    result: RunResult, done: list[RequestRecord], ideal_prefix_hit_tokens: int | None
) -> dict[str, Any]:
    """The run, its requests, their tokens and prefix hits, and the throughput."""
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.num_output_tokens for r in done)
    hit = sum(r.prefix_hit_tokens for r in done)
    dur = result.duration_s
    return {
        "policy": result.policy.name,
        "allocator": result.policy.allocator,
        "block_size": result.block_size,
        "prefix_caching": result.policy.prefix_caching,
        "num_kv_slots": result.num_kv_slots,
        "num_requests": len(result.records),
        "num_finished": len(done),
        "refused": sum(r.refused for r in result.records),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "prefix_hit_tokens": hit,
        "prefix_hit_rate": round(hit / prompt, 6) if prompt else 0.0,
        "ideal_prefix_hit_tokens": ideal_prefix_hit_tokens,
        "duration_s": round(dur, 6),
        "num_steps": result.num_steps,
        "throughput_tokens_per_s": round(output / dur, 3) if dur > 0 else 0.0,
        "total_tokens_per_s": round((prompt + output) / dur, 3) if dur > 0 else 0.0,
    }


def _latencies(done: list[RequestRecord]) -> dict[str, Any]:
    """TTFT, TPOT and end-to-end percentiles of the finished requests, and the mean
    normalized latency (end-to-end seconds per output token)."""
    out: dict[str, Any] = {}
    for name in ("ttft", "tpot", "e2e"):
        values = [v for r in done if (v := getattr(r, f"{name}_s")) is not None]
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = _round(percentile(values, q))
    normalized = [r.e2e_s / max(1, r.num_output_tokens) for r in done]  # type: ignore[operator]
    out["normalized_latency_s_per_token"] = (
        round(sum(normalized) / len(normalized), 6) if normalized else None
    )
    return out


def _pool(result: RunResult) -> dict[str, Any]:
    """The pool over the run (concurrency, utilization, waste) and what preemption and swap
    cost."""
    s = result.series
    return dict(
        peak_running=result.peak_running,
        mean_running=round(result.mean_running, 3),
        kv_utilization_mean=round(s.mean("kv_utilization"), 6),
        kv_utilization_peak=round(max(s.kv_utilization, default=0.0), 6),
        fragmentation_mean=round(s.mean("fragmentation_frac"), 6),
        reserved_unused_mean=round(s.mean("reserved_unused_frac"), 6),
        cached_mean=round(s.mean("cached_frac"), 6),
        preemptions=result.preemptions,
        recomputed_tokens=result.recomputed_tokens,
        evictions=result.evictions,
        swap_outs=result.swap_outs,
        swap_ins=result.swap_ins,
        swapped_blocks_out=result.swapped_blocks_out,
        swapped_blocks_in=result.swapped_blocks_in,
        swap_fallbacks=result.swap_fallbacks,
        swap_time_s=round(result.swap_time_s, 6),
        wall_time_s=round(result.wall_time_s, 3),
    )


def _partial_hits(result: RunResult) -> dict[str, Any]:
    """Partial-block reuse's counts, only when the prefix match unit is below the block."""
    unit = result.policy.prefix_match_unit
    if unit is None or unit >= result.block_size:
        return {}
    return dict(
        prefix_match_unit=unit,
        partial_hits=result.partial_hits,
        partial_hit_tokens=result.partial_hit_tokens,
        partial_claims=result.partial_claims,
        prefix_copy_bytes=result.prefix_copy_bytes,
        prefix_copy_time_s=round(result.prefix_copy_time_s, 6),
    )
