"""Engine statistics: what paging bought, measured step by step on the real model.

The engine's one face for the edges: ``EngineInfo`` (fixed facts, any thread may read it),
``EngineSnapshot`` (the state after a step) and ``EngineStats`` (the run's summary). The server,
``demo`` and ``generate`` read these, never the allocator, scheduler or recorder
(``engine/step/stats_recorder.py``, which samples every step and makes the last two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.kvcache.tiers.counts import TierCounts, tier_rows
from pagedkv.kvstore.counters import store_rows

if TYPE_CHECKING:  # this module must not import torch (a router reads EngineInfo)
    from pagedkv.engine.startup import EngineParts


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, fixed at start-up. ``num_blocks`` counts usable blocks (the null
    block excluded): the same count as every snapshot, error message and metric."""

    policy: str
    backend: str
    block_size: int  # tokens per block
    num_blocks: int
    max_model_len: int  # tokens
    vocab_size: int
    record_bytes: int  # one token's K and V across all layers
    kv_cache_bytes: int  # the KV pools of every layer, as allocated
    page_format: dict[str, str]  # the page-format fingerprint, as strings
    device: str = "cpu"  # where the model runs: "cpu", "cuda:0"
    dtype: str = "float32"  # activations and weights (the KV dtype is the page format's)
    attention_backend: str = "native"
    prefix_match_unit: int | None = None  # tokens; None = whole blocks (kvcache/partial.py)

    def labels(self) -> dict[str, str]:
        """The page format plus policy and backend: labels for a metrics info series."""
        return {**self.page_format, "policy": self.policy, "backend": self.backend}

    def placement(self) -> dict[str, str]:
        """Where and how the model runs: ``/pagedkv/info``'s and a metrics info's fields."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "attention_backend": self.attention_backend,
        }

    @classmethod
    def from_parts(cls, p: EngineParts) -> EngineInfo:
        return cls(
            policy=p.policy.name,
            backend=p.resolution.backend,
            block_size=p.allocator.block_size,
            num_blocks=p.allocator.num_total_blocks,
            max_model_len=p.max_model_len,
            vocab_size=p.model_config.vocab_size,
            record_bytes=p.layout.record_bytes,
            kv_cache_bytes=p.runner.kv_cache_bytes,
            page_format={k: str(v) for k, v in p.page_format.to_dict().items()},
            prefix_match_unit=p.policy.prefix_match_unit,
            **(
                {}
                if p.placement is None
                else {
                    "device": str(p.placement.device),
                    "dtype": p.placement.dtype,
                    "attention_backend": p.placement.attention_backend,
                }
            ),
        )


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state between two steps; every field counts blocks, sequences or tokens."""

    num_total_blocks: int  # usable blocks
    num_empty_blocks: int  # blocks that hold nothing reusable
    num_used_blocks: int  # blocks referenced by a live sequence
    num_cached_blocks: int  # unreferenced blocks kept for prefix hits
    kv_utilization: float  # used slots / pool slots
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_running_seqs: int
    num_waiting_seqs: int
    peak_running_seqs: int  # most sequences in one step's batch since start
    num_preemptions: int
    generated_tokens: int
    num_steps: int
    num_unfinished_requests: int  # added, not yet reported finished
    num_failed_requests: int  # requests a failure inside a step ended (the rest went on)
    # Lower KV tiers (kvcache/tiers/contract.py): hit tokens per tier ("device" first; empty without
    # lower tiers) and the blocks / bytes they copied (None without lower tiers).
    tier_hit_tokens: tuple[tuple[str, int], ...] = ()
    tier_moves: TierCounts | None = None
    # The store tier's counters (kvstore/counters.py StoreCounters.as_dict: bytes read and
    # written, blocks written and dropped, errors, rejected_<reason>); empty without a store.
    kv_store: tuple[tuple[str, int], ...] = ()
    # Swap preemption (swap_counts below; all 0 under recompute).
    num_swap_outs: int = 0  # sequences swapped out to the host pool
    num_swap_ins: int = 0  # sequences swapped back in
    num_swapped_blocks_out: int = 0
    num_swapped_blocks_in: int = 0
    num_swap_fallbacks: int = 0  # victims the full host pool sent to recompute instead
    swap_out_bytes: int = 0  # KV bytes copied device -> host
    swap_in_bytes: int = 0  # host -> device
    # Partial-block reuse (kvcache/partial.py): hits ending inside a block, their tokens there
    # (part of prefix_hit_tokens), KV bytes copied for them, blocks claimed in place instead.
    num_partial_hits: int = 0
    partial_hit_tokens: int = 0
    prefix_copy_bytes: int = 0
    num_partial_claims: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_steps: int
    elapsed_s: float
    computed_tokens: int  # tokens that went through the model (prompts, recomputes, decodes)
    generated_tokens: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    peak_used_blocks: int
    total_blocks: int
    kv_utilization_mean: float  # used slots / pool, averaged over steps
    kv_utilization_peak: float
    peak_running: int
    preemptions: int
    tier_hit_tokens: tuple[tuple[str, int], ...] = ()  # of prefix_hit_tokens, per tier
    kv_store: tuple[tuple[str, int], ...] = ()  # as in EngineSnapshot
    swap_outs: int = 0  # sequences swapped out (of ``preemptions``)
    swap_ins: int = 0
    swap_bytes: int = 0  # KV bytes copied both ways
    # As in EngineSnapshot: partial-block hits, their tokens, bytes copied, blocks claimed.
    partial_hits: int = 0
    partial_hit_tokens: int = 0
    prefix_copy_bytes: int = 0
    partial_claims: int = 0

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for a two-column table."""
        hit = self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0
        return (
            [
                ("generated tokens", f"{self.generated_tokens}"),
                ("generated tokens/s", f"{self.generated_tokens_per_s:.1f}"),
                ("steps", f"{self.num_steps}"),
                (
                    "prefix-hit tokens",
                    f"{self.prefix_hit_tokens} of {self.prefix_query_tokens} ({hit:.1%})",
                ),
                ("peak blocks in use", f"{self.peak_used_blocks} of {self.total_blocks}"),
                (
                    "KV utilization mean / peak",
                    f"{self.kv_utilization_mean:.1%} / {self.kv_utilization_peak:.1%}",
                ),
                ("peak running sequences", f"{self.peak_running}"),
                ("preemptions", f"{self.preemptions}"),
                *tier_rows(self.tier_hit_tokens),
                *store_rows(self.kv_store),
            ]
            + self._swap_rows()
            + self._partial_rows()
        )

    def _partial_rows(self) -> list[tuple[str, str]]:
        hits = f"{self.partial_hits} ({self.partial_hit_tokens} tokens; {self.prefix_copy_bytes}"
        hits += f" bytes copied, {self.partial_claims} blocks claimed in place)"
        return [("partial-block hits", hits)] if self.partial_hits else []

    def _swap_rows(self) -> list[tuple[str, str]]:
        if not (self.swap_outs or self.swap_ins):
            return []
        moved = f"{self.swap_outs} / {self.swap_ins} ({self.swap_bytes / 2**20:.1f} MiB moved)"
        return [("sequences swapped out / in", moved)]
