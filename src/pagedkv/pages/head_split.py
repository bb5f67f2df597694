"""How tensor parallelism splits a model's attention heads over its ranks: the one rule, read by
the engine (which rows of each weight a rank loads, what its pool holds), the page format (a
rank's head range), the planner and the simulator (a rank's page bytes).

vLLM's rule: the query heads split evenly (``num_heads % tp_size == 0``); the KV heads split
evenly when there are at least as many as ranks (``num_kv_heads % tp_size == 0``), else each
rank holds one KV head, *replicated* over ``tp_size // num_kv_heads`` ranks
(``tp_size % num_kv_heads == 0``). Anything else is refused in one line. Rank ``r``'s query heads
are the ``r``-th run of ``num_heads // tp_size``; they all read the one group of KV heads rank
``r`` holds, so attention needs no communication. An MLA latent is not split: every rank holds
all of it (its record is the whole model's). Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedkv.errors import UsageError
from pagedkv.pages.layout import KVLayout

PARAM = "tensor_parallel_size"


@dataclass(frozen=True)
class HeadSplit:
    """The heads of ``tp_size`` ranks of one model: validated on construction (``UsageError``
    naming ``--tensor-parallel-size`` and both numbers when the heads do not divide)."""

    tp_size: int
    num_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise UsageError(
                f"--tensor-parallel-size must be a whole number >= 1, got {tp!r}", PARAM
            )
        if self.num_heads % tp:
            raise UsageError(
                f"--tensor-parallel-size {tp} does not divide the model's {self.num_heads} query "
                f"heads (sizes that do: {', '.join(map(str, self.sizes_that_divide()))})",
                PARAM,
            )
        kv = self.num_kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise UsageError(
                f"--tensor-parallel-size {tp} neither divides the model's {kv} KV heads nor is a "
                f"multiple of them (sizes that work: {', '.join(map(str, self.sizes_that_divide()))})",
                PARAM,
            )

    def sizes_that_divide(self, most: int = 64) -> list[int]:
        """The tensor-parallel sizes up to ``most`` that this model's heads allow."""
        kv = self.num_kv_heads
        return [
            n
            for n in range(1, most + 1)
            if self.num_heads % n == 0 and ((kv >= n and kv % n == 0) or (kv < n and n % kv == 0))
        ]

    @property
    def rank_heads(self) -> int:
        """Query heads of each rank."""
        return self.num_heads // self.tp_size

    @property
    def rank_kv_heads(self) -> int:
        """KV heads each rank holds (1 where they are replicated)."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold each KV head (1: split, no copy)."""
        return max(1, self.tp_size // self.num_kv_heads)

    def heads(self, rank: int) -> range:
        """Rank ``rank``'s query heads."""
        self._check_rank(rank)
        return range(rank * self.rank_heads, (rank + 1) * self.rank_heads)

    def kv_heads(self, rank: int) -> range:
        """Rank ``rank``'s KV heads (the group its query heads read)."""
        self._check_rank(rank)
        start = rank // self.kv_replicas * self.rank_kv_heads
        return range(start, start + self.rank_kv_heads)

    def owners(self) -> list[int]:
        """One rank per distinct KV head range, in head order: the ranks whose pages, joined,
        hold every KV head once (the first of each head's replicas)."""
        return list(range(0, self.tp_size, self.kv_replicas))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} outside 0..{self.tp_size - 1}")

    def describe(self) -> str:
        """``"2 ranks: 4 query heads and 1 KV head each (KV heads replicated on 2 ranks)"``."""
        copies = (
            f" (KV heads replicated on {self.kv_replicas} ranks)" if self.kv_replicas > 1 else ""
        )
        kv = "KV head" if self.rank_kv_heads == 1 else "KV heads"
        return (
            f"{self.tp_size} ranks: {self.rank_heads} query heads and {self.rank_kv_heads} {kv} "
            f"each{copies}"
        )


def rank_layout(layout: KVLayout, tp_size: int, num_heads: int | None = None) -> KVLayout:
    """The layout of one rank's pages at ``tp_size`` (the ranks' layouts differ in which heads,
    never in bytes): its KV heads (``HeadSplit``'s rule, checked when ``num_heads``, the query
    heads, is known) for MHA; the whole latent for MLA; an explicit record split evenly. Its
    ``num_params`` are a rank's share of the weights."""
    if tp_size == 1:
        return layout
    params = None if layout.num_params is None else layout.num_params // tp_size
    if layout.attention == "mha":
        heads = num_heads or layout.query_dim // layout.head_dim
        # Query heads unknown (a layout without them): only the KV heads' rule is checked.
        split = HeadSplit(tp_size, heads or layout.num_kv_heads * tp_size, layout.num_kv_heads)
        return replace(layout, num_kv_heads=split.rank_kv_heads, num_params=params)
    if layout.attention == "explicit":
        record = -(-layout.explicit_record_bytes // tp_size)
        return replace(layout, explicit_record_bytes=record, num_params=params)
    return replace(layout, num_params=params)
