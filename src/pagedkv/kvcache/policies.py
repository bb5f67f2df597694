"""Framework policies as data: each preset names an allocator, a block size and a prefix mode
(whole blocks, or a prefix-match unit below the block size: ``partial.py``).

The simulator and the engine both build their allocator here, so a simulated ``vllm`` run and an
engine run with ``--policy vllm`` page memory the same way. The block sizes are the ones the
first article tabulates for each framework's default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from pagedkv.kvcache.paged import PagedAllocator
from pagedkv.kvcache.partial import check_prefix_match_unit
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvcache.radix import RadixAllocator
from pagedkv.kvcache.reserved import ReservedAllocator
from pagedkv.units import check_block_size

AllocatorKind = Literal["paged", "radix", "reserved"]
ALLOCATOR_KINDS: tuple[str, ...] = ("paged", "radix", "reserved")


@dataclass(frozen=True)
class Policy:
    """How a framework pages its KV cache. ``block_size`` is None for ``reserved`` (one region
    of ``max_model_len`` slots per sequence). ``prefix_match_unit``: the tokens a prefix match
    counts in (None: the block size, whole blocks); below the block size a match may end
    inside a block (paged allocators with a prefix cache only)."""

    name: str
    allocator: AllocatorKind
    block_size: int | None
    prefix_caching: bool
    description: str
    prefix_match_unit: int | None = None

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATOR_KINDS:
            raise ValueError(f"unknown allocator {self.allocator!r}; one of {ALLOCATOR_KINDS}")
        if self.block_size is not None:
            check_block_size(self.block_size)
        if self.prefix_match_unit is not None:
            if not self.prefix_caching or self.allocator == "reserved":
                raise ValueError(f"policy {self.name} has no prefix cache to match prefixes in")
            check_prefix_match_unit(self.prefix_match_unit)  # its block size: unit_problem

    def unit_problem(self, block_size: int | None = None) -> str | None:
        """Why this policy cannot match prefixes in its unit at ``block_size`` (None: its
        own), or None when it can: the unit must divide the block size, and a radix tree
        matches whole pages."""
        unit, size = self.prefix_match_unit, block_size or self.block_size
        if unit is None or size is None:
            return None
        if size % unit:
            return f"the prefix match unit ({unit} tokens) must divide the block size ({size})"
        if self.allocator == "radix" and unit != size:
            return (
                f"the radix allocator matches whole pages of {size}; for reuse at any token "
                "use page 1 (sglang, radix:1)"
            )
        return None

    def build(
        self, num_blocks: int, max_model_len: int, block_size: int | None = None
    ) -> KVAllocator:
        """This policy's allocator over ``num_blocks`` blocks of ``block_size`` tokens (None:
        the preset's; ``reserved``: a block is one ``max_model_len`` region). A pool of less
        than two blocks, or a prefix match unit the block size cannot take, is a ValueError."""
        policy = self.with_block_size(block_size)
        problem = policy.unit_problem()
        if problem is not None:
            raise ValueError(f"policy {policy.name}: {problem}")
        if policy.allocator == "reserved":
            return ReservedAllocator(num_blocks * max_model_len, max_model_len)
        assert policy.block_size is not None
        if policy.allocator == "radix":
            return RadixAllocator(num_blocks * policy.block_size, page_size=policy.block_size)
        return PagedAllocator(
            num_blocks,
            policy.block_size,
            prefix_caching=policy.prefix_caching,
            prefix_match_unit=policy.prefix_match_unit,
        )

    def with_block_size(self, block_size: int | None) -> Policy:
        """The same policy at another block size (``None`` keeps the preset's)."""
        if block_size is None or self.allocator == "reserved":
            return self
        return replace(self, name=f"{self.name}@{block_size}", block_size=block_size)

    def with_prefix_match_unit(self, unit: int | None) -> Policy:
        """The same policy matching prefixes in units of ``unit`` tokens (None keeps the
        preset's); ValueError when it has no prefix cache or ``unit`` < 1. Whether its block
        size can take the unit is ``unit_problem``'s answer."""
        if unit is None or unit == self.prefix_match_unit:
            return self
        if not self.prefix_caching or self.allocator == "reserved":
            raise ValueError(f"policy {self.name} has no prefix cache to match prefixes in")
        return replace(self, name=f"{self.name}+u{unit}", prefix_match_unit=unit)


# TRT-LLM's KV cache reuses partially matched blocks by default (``enable_partial_reuse`` and
# ``copy_on_partial_reuse`` on in its ``KvCacheConfig``), at token granularity.
_TRTLLM = "paged blocks of 64, partial-block reuse at any token (copied, or claimed when unused)"

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("vllm", "paged", 16, True, "paged blocks of 16, full-block hash-chain prefix cache"),
        Policy("sglang", "radix", 1, True, "radix tree over tokens, page size 1, LRU leaves"),
        Policy("trtllm", "paged", 64, True, _TRTLLM, prefix_match_unit=1),
        Policy("llamacpp", "paged", 1, False, "token cells, no cross-request prefix cache"),
        Policy("deepinfer", "paged", 128, False, "paged blocks of 128, sharing by explicit fork"),
        Policy("reserved", "reserved", None, False, "one contiguous max_model_len region each"),
    )
}


# The allocators ``KIND:B`` may name (reserved has no block size to give).
_EXPLICIT_KINDS: dict[str, AllocatorKind] = {"paged": "paged", "radix": "radix"}


def get_policy(name: str) -> Policy:
    """A preset by name, or ``KIND:B`` for an explicit combination (``paged:32``,
    ``radix:16``, ``paged-nocache:8``); ValueError lists the choices."""
    if name in POLICIES:
        return POLICIES[name]
    kind, sep, size = name.partition(":")
    caching = not kind.endswith("-nocache")
    allocator = _EXPLICIT_KINDS.get(kind.removesuffix("-nocache"))
    if sep and allocator is not None and size.isdigit() and int(size) >= 1:
        return Policy(
            name, allocator, int(size), caching, f"explicit {allocator} allocator, block {size}"
        )
    raise ValueError(
        f"unknown policy {name!r}; presets: {', '.join(POLICIES)}; "
        "or KIND:B with KIND in paged, paged-nocache, radix and B >= 1"
    )


def build_allocator(
    policy: Policy | str, num_slots: int, max_model_len: int, block_size: int | None = None
) -> KVAllocator:
    """An allocator over a pool of ``num_slots`` token slots (the simulator's unit: one pool's
    bytes, whatever each policy's block), ``Policy.build`` over its whole blocks.
    ``block_size`` overrides the preset's (ignored for ``reserved``)."""
    if isinstance(policy, str):
        policy = get_policy(policy)
    policy = policy.with_block_size(block_size)
    if policy.allocator == "reserved":  # its utilisation counts every slot, a partial region too
        return ReservedAllocator(num_slots, max_model_len)
    assert policy.block_size is not None
    return policy.build(num_slots // policy.block_size, max_model_len)
