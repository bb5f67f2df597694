"""What a page of KV means (``PageFormat``) and the one rule for whether two formats match.

A ``PageFormat`` travels with any exported KV (the store namespace, the P/D handshake, a
replica's ``/pagedkv/info``). Every place that asks "may these two processes share KV pages?"
compares through ``format_differences``: the router and the P/D pair add their own non-page
fields (model, tokenizer, hash algorithm), never their own page-field comparison.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, fields

from pagedkv.errors import UsageError
from pagedkv.pages.layout import KVLayout, mha_layout
from pagedkv.units import check_block_size


@dataclass(frozen=True)
class PageFormat:
    """What a page of KV means: two processes may share KV only if these fields all match."""

    block_size: int
    attention: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    record_bytes: int

    @classmethod
    def from_layout(cls, layout: KVLayout, block_size: int) -> PageFormat:
        check_block_size(block_size)
        return cls(
            block_size=block_size,
            attention=layout.attention,
            kv_dtype=layout.kv_dtype,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            kv_lora_rank=layout.kv_lora_rank,
            qk_rope_head_dim=layout.qk_rope_head_dim,
            record_bytes=layout.record_bytes,
        )

    @classmethod
    def mha(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, block_size: int
    ) -> PageFormat:
        """The page of an MHA/GQA pool (``layout.mha_layout``): what an engine's pools, and the
        tests' and benchmarks' own, are sized by."""
        return cls.from_layout(mha_layout(num_layers, num_kv_heads, head_dim, kv_dtype), block_size)

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, int | str]) -> PageFormat:
        """Inverse of ``to_dict``; unknown or missing keys are errors."""
        names = set(PAGE_FORMAT_FIELDS)
        if set(data) != names:
            raise UsageError(f"page format keys differ: got {sorted(data)}, need {sorted(names)}")
        return cls(**data)  # type: ignore[arg-type]

    def check_compatible(self, other: PageFormat, bridged: Collection[str] = ()) -> None:
        """Raise UsageError naming both sides of every differing field (``bridged`` fields
        excepted); return if they match."""
        diffs = format_differences(self.to_dict(), other.to_dict(), bridged)
        if diffs:
            raise UsageError(
                "KV page format mismatch: "
                + "; ".join(f"{name} {mine} here vs {theirs} there" for name, mine, theirs in diffs)
            )


PAGE_FORMAT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(PageFormat))


def format_differences(
    mine: Mapping[str, object], theirs: Mapping[str, object], bridged: Collection[str] = ()
) -> list[tuple[str, object, object]]:
    """``(field, mine, theirs)`` for every page-format field in which the two differ, in
    ``PAGE_FORMAT_FIELDS`` order, then any other key either side carries (a peer of another
    version), sorted; a key one side lacks reads as None. ``bridged`` names fields the caller
    can convert between (a relayout import bridges ``block_size``); they are not compared.
    Takes mappings, not ``PageFormat``s, so a peer's unvalidated JSON can be compared too."""
    extra = sorted((set(mine) | set(theirs)) - set(PAGE_FORMAT_FIELDS))
    return [
        (name, mine.get(name), theirs.get(name))
        for name in (*PAGE_FORMAT_FIELDS, *extra)
        if name not in bridged and mine.get(name) != theirs.get(name)
    ]
