"""What a page of KV means (``PageFormat``) and the one rule for whether two formats match.

A ``PageFormat`` travels with any exported KV (the store namespace, the P/D handshake, a
replica's ``/pagedkv/info``). Every place that asks "may these two processes share KV pages?"
compares through ``format_differences``: the router and the P/D pair add their own non-page
fields (model, tokenizer, hash algorithm), never their own page-field comparison.

Under tensor parallelism (``head_split.py``) each rank's pool holds only its KV heads: its page
format says so (``tp_size``, ``kv_head_start``, ``num_kv_heads`` of ``model_kv_heads``, and the
rank's ``record_bytes``), and ``whole`` is the format of the same pages joined over the ranks
(what one rank at ``tp_size`` 1 holds, and what the store keeps). Two engines of one model at
different sizes differ only in those fields: compared ``across_ranks`` they match.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, fields, replace

from pagedkv.errors import UsageError
from pagedkv.pages.head_split import HeadSplit
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
    # Tensor parallelism: the engine's ranks, and this rank's KV heads in the model's, the range
    # [kv_head_start, kv_head_start + num_kv_heads) of model_kv_heads (0 = num_kv_heads).
    tp_size: int = 1
    kv_head_start: int = 0
    model_kv_heads: int = 0

    def __post_init__(self) -> None:
        if self.model_kv_heads == 0 or self.tp_size == 1:  # one rank holds every head
            object.__setattr__(self, "model_kv_heads", self.num_kv_heads)

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

    def for_rank(self, split: HeadSplit, rank: int) -> PageFormat:
        """The page of rank ``rank`` of ``split`` (this format must be the whole model's): its
        KV heads and their record bytes for MHA; an MLA latent is every rank's whole."""
        if self.tp_size != 1:
            raise ValueError("for_rank splits the whole model's page format")
        if self.attention != "mha":
            return replace(self, tp_size=split.tp_size)
        heads = split.kv_heads(rank)
        layout = mha_layout(self.num_layers, len(heads), self.head_dim, self.kv_dtype)
        return replace(
            self,
            num_kv_heads=len(heads),
            record_bytes=layout.record_bytes,
            tp_size=split.tp_size,
            kv_head_start=heads.start,
            model_kv_heads=self.num_kv_heads,
        )

    def whole(self) -> PageFormat:
        """The same pages joined over the ranks: the format at ``tp_size`` 1 (itself there)."""
        return PageFormat(**whole_of(self.to_dict()))  # type: ignore[arg-type]

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
# What differs between the ranks of one engine, or two sizes of one model: ``whole_of`` maps
# them to the whole model's values.
RANK_FIELDS = ("num_kv_heads", "record_bytes", "tp_size", "kv_head_start", "model_kv_heads")


def whole_of(page: Mapping[str, object]) -> dict[str, object]:
    """A page-format mapping (maybe a peer's, unvalidated) with its rank fields replaced by the
    whole model's: every KV head, their record bytes (a rank's scale with its heads: K and V
    of ``head_dim`` per head, scales included), one rank. An MHA mapping whose head fields are
    not positive integers is returned as it is (a comparison then names them), and so is one
    of one rank (``tp_size`` 1 or absent: the whole model's already)."""
    out = dict(page)
    if page.get("tp_size", 1) == 1:
        return out
    heads, model_heads, record = (
        page.get(k) for k in ("num_kv_heads", "model_kv_heads", "record_bytes")
    )
    if page.get("attention") == "mha":
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0
            for v in (heads, model_heads, record)
        ):
            return out
        out["record_bytes"] = record * model_heads // heads  # type: ignore[operator]
        out["num_kv_heads"] = model_heads
    out["tp_size"], out["kv_head_start"] = 1, 0
    return out


def format_differences(
    mine: Mapping[str, object],
    theirs: Mapping[str, object],
    bridged: Collection[str] = (),
    across_ranks: bool = False,
) -> list[tuple[str, object, object]]:
    """``(field, mine, theirs)`` for every page-format field in which the two differ, in
    ``PAGE_FORMAT_FIELDS`` order, then any other key either side carries (a peer of another
    version), sorted; a key one side lacks reads as None. ``bridged`` names fields the caller
    can convert between (a relayout import bridges ``block_size``); they are not compared.
    Takes mappings, not ``PageFormat``s, so a peer's unvalidated JSON can be compared too.
    ``across_ranks``: both are compared as the whole model's pages (``whole_of``), so engines
    of one model at different tensor-parallel sizes match (their KV moves by head slices)."""
    if across_ranks:
        mine, theirs = whole_of(mine), whole_of(theirs)
    extra = sorted((set(mine) | set(theirs)) - set(PAGE_FORMAT_FIELDS))
    return [
        (name, mine.get(name), theirs.get(name))
        for name in (*PAGE_FORMAT_FIELDS, *extra)
        if name not in bridged and mine.get(name) != theirs.get(name)
    ]
