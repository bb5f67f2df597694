"""Capacity on one pool: how many tokens of KV each model's records fit in the same bytes (an
MLA model's one latent record per token and layer against a GQA model's K and V per KV head).
Record and block bytes come from the one layout (``pages/layout.py``: the engine's start-up
line, the planner and the simulator ask it too); a pool holds whole blocks. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.pages.layout import KVLayout


@dataclass(frozen=True)
class Capacity:
    """One model's pool: ``tokens`` = ``num_blocks`` whole blocks of ``block_size`` tokens."""

    model: str
    attention: str
    kv_dtype: str
    num_layers: int
    record_bytes: int
    num_params: int | None
    block_size: int
    block_bytes: int
    num_blocks: int
    tokens: int

    @property
    def record_bytes_per_billion_params(self) -> float | None:
        """KV bytes a token costs per 10^9 weights: a size-fair comparison of two models."""
        return None if not self.num_params else self.record_bytes / (self.num_params / 1e9)


def pool_capacity(layout: KVLayout, pool_bytes: int, block_size: int) -> Capacity:
    """``layout``'s pool of ``pool_bytes`` in blocks of ``block_size`` tokens."""
    block_bytes = layout.block_bytes(block_size)
    num_blocks = pool_bytes // block_bytes
    return Capacity(
        model=layout.name,
        attention=layout.attention,
        kv_dtype=layout.kv_dtype,
        num_layers=layout.num_layers,
        record_bytes=layout.record_bytes,
        num_params=layout.num_params,
        block_size=block_size,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        tokens=num_blocks * block_size,
    )
