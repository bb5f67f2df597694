"""Hard constraints on the block size (the kernel rules table) and its resolution at start-up.

The article's fourth ledger: attention kernels fix the page size (FlashMLA only 64, FA4 128,
...), block bases may need an alignment, and a kernel that forms ``block_id * block_bytes`` in
int32 limits the pool. ``resolve_block_size`` turns a user value into the value used, recording
every rewrite with its reason ("the log line is the truth"). The page-format fingerprint that
travels with exported KV lives in ``pages/page_format.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.errors import UsageError
from pagedkv.pages import backends
from pagedkv.pages.layout import KVLayout, int32_max_pool_blocks, is_aligned
from pagedkv.pages.triton_rules import DEFAULT_BLOCK_SIZE
from pagedkv.units import check_block_size

ANY_BLOCK_SIZE: tuple[int, ...] = ()  # empty = every block size >= 1 is accepted


@dataclass(frozen=True)
class Backend:
    """An attention backend's page contract.

    ``allowed_block_sizes`` (empty = any >= 1); ``fallback_block_size`` is what an out-of-set
    request is rewritten to; ``layouts`` are the attention kinds the kernel reads ("explicit"
    layouts, known only by record bytes, are always admitted); ``alignment_bytes`` applies to
    each layer's block base; ``int32_offsets`` says the kernel forms byte offsets in int32.
    ``kernel_problems`` (block size, head dim or None) -> reasons: a backend whose kernels are
    pagedkv's own states *why* a size is refused, in the kernels' own words
    (``pages/triton_rules.py``), which also decide what it accepts.
    """

    name: str
    default_block_size: int
    allowed_block_sizes: tuple[int, ...] = ANY_BLOCK_SIZE
    fallback_block_size: int | None = None
    layouts: tuple[str, ...] = ("mha", "mla")
    alignment_bytes: int = 1
    int32_offsets: bool = False
    note: str = ""
    kernel_problems: Callable[[int, int | None], list[str]] | None = None
    loops_over_tiles: bool = False  # its loop count is tiles of the context, not ceil(L / B)

    @classmethod
    def of_rule(cls, rule: backends.BackendRule) -> Backend:
        """One of pagedkv's own backends, from the declaration its engine backend carries."""
        return cls(
            rule.name,
            DEFAULT_BLOCK_SIZE,
            ANY_BLOCK_SIZE,
            DEFAULT_BLOCK_SIZE,
            rule.layouts,
            note=rule.note,
            kernel_problems=rule.problems,
            loops_over_tiles=rule.loops_over_tiles,
        )

    def allows(self, block_size: int) -> bool:
        """Whether the kernel accepts this block size (alignment and offsets not included)."""
        if block_size < 1:
            return False
        return not self.allowed_block_sizes or block_size in self.allowed_block_sizes


_MLA = ("mla",)
# The article's table (SGLang's backend page constraints, vLLM's platform rules, DeepInfer's
# model metadata), plus pagedkv's own backends, which index pages in Python/torch with int64.
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("torch-sdpa-reserved", 16, note="pagedkv contiguous max_len baseline"),
        Backend("flashmla", 64, (64,), 64, _MLA, note="FlashMLA: only 64"),
        Backend("flashinfer-mla", 1, note="FlashInfer / Triton MLA (SGLang's defaults): any"),
        Backend("trtllm-mla", 64, (32, 64), 64, _MLA, note="TRT-LLM MLA: 32/64"),
        Backend("tokenspeed-mla", 64, (32, 64), 64, _MLA, note="tokenspeed_mla: 32/64"),
        Backend("cutedsl-mla", 64, (32, 64), 64, _MLA, note="CuteDSL MLA: 32/64"),
        Backend("trtllm-mha", 64, (16, 32, 64, 128), 64, ("mha",), note="TRT-LLM MHA"),
        Backend("hpc-ops", 64, (64,), 64, note="HPC-Ops: only 64"),
        Backend("fa4", 128, (128,), 128, ("mha",), note="FA4 (non-MLA): 128"),
        Backend("vllm", 16, (1, 8, 16, 32, 64, 128), 16, note="vLLM CacheConfig BlockSize set"),
        Backend(
            "deepinfer", 128, (128,), 128, alignment_bytes=128, note="fixed 128, 128 B aligned"
        ),
        # pagedkv's own backends: their engine declarations, read as they are (one copy).
        *(Backend.of_rule(rule) for rule in backends.RULES.values()),
    )
}


def get_backend(name: str) -> Backend:
    """The backend called ``name``; ValueError naming the known ones if none."""
    if name not in BACKENDS:
        raise UsageError(f"unknown attention backend {name!r} (known: {', '.join(BACKENDS)})")
    return BACKENDS[name]


def constraint_violations(
    block_size: int, backend: Backend, layout: KVLayout, num_blocks: int | None = None
) -> list[str]:
    """Why ``block_size`` breaks a hard constraint (empty list: it is allowed)."""
    reasons: list[str] = []
    if backend.kernel_problems is not None:
        head_dim = layout.head_dim if layout.attention == "mha" else None
        reasons.extend(backend.kernel_problems(block_size, head_dim))
    elif not backend.allows(block_size):
        sizes = "/".join(map(str, backend.allowed_block_sizes)) or "any >= 1"
        reasons.append(f"{backend.name} supports block sizes {sizes} only")
    if layout.attention != "explicit" and layout.attention not in backend.layouts:
        reasons.append(f"{backend.name} does not read {layout.attention.upper()} layouts")
    layer_block_bytes = layout.layer_block_bytes(max(block_size, 1))
    if not is_aligned(layer_block_bytes, backend.alignment_bytes):
        reasons.append(
            f"block bytes per layer {layer_block_bytes} are not a multiple of "
            f"the {backend.alignment_bytes}-byte base alignment"
        )
    if backend.int32_offsets and num_blocks is not None:
        limit = int32_max_pool_blocks(layer_block_bytes)
        if num_blocks > limit:
            reasons.append(f"{num_blocks} blocks overflow int32 byte offsets (max {limit})")
    return reasons


@dataclass(frozen=True)
class BlockSizeResolution:
    """The block size used and how it was reached: ``rewrites`` are (from, to, reason)."""

    block_size: int
    backend: str
    rewrites: list[tuple[int | None, int, str]] = field(default_factory=list)

    def log_line(self) -> str:
        """The one start-up line that tells the truth about the block size."""
        if not self.rewrites:
            return f"block_size={self.block_size} tokens (backend {self.backend})"
        steps = "; ".join(f"{a} -> {b}: {why}" for a, b, why in self.rewrites)
        return f"block_size={self.block_size} tokens (backend {self.backend}; {steps})"


def resolve_block_size(
    requested: int | None, backend: str, layout: KVLayout, num_blocks: int | None = None
) -> BlockSizeResolution:
    """User value -> default -> backend set -> alignment; returns the value and every rewrite.

    Raises UsageError for ``requested < 1``, an unknown backend, a layout the backend cannot
    read, or when no allowed block size satisfies the alignment / int32-offset limits.
    """
    spec = get_backend(backend)
    if requested is not None:
        check_block_size(requested)
    if layout.attention != "explicit" and layout.attention not in spec.layouts:
        raise UsageError(f"backend {backend} cannot read the {layout.attention.upper()} layout")
    rewrites: list[tuple[int | None, int, str]] = []
    block_size = requested
    if block_size is None:
        block_size = spec.default_block_size
        rewrites.append((None, block_size, f"no block size given: {backend} default"))
    # A head dim the kernels refuse cannot be cured by any block size.
    head_dim = layout.head_dim if layout.attention == "mha" else None
    found = []
    if spec.kernel_problems is not None and head_dim is not None:  # at a size it accepts
        found = spec.kernel_problems(spec.default_block_size, head_dim)
    if found:
        raise UsageError(f"backend {backend} cannot run this model: {'; '.join(found)}")
    if not spec.allows(block_size):
        target = spec.fallback_block_size or spec.default_block_size
        sizes = "/".join(map(str, spec.allowed_block_sizes))
        why = f"{backend} only supports {sizes}"
        if spec.kernel_problems is not None:  # the kernel's own reason, as vLLM prints its
            why = "; ".join(spec.kernel_problems(block_size, None)) + f" ({why})"
        rewrites.append((block_size, target, why))
        block_size = target
    if constraint_violations(block_size, spec, layout, num_blocks):
        # Alignment or offsets: take the smallest larger block size that satisfies everything.
        # B * record_bytes is aligned for every multiple of alignment / gcd(record, alignment),
        # so a window of `alignment_bytes` sizes above B holds one if any does; a larger block
        # never cures an int32 overflow of a fixed block count, so that ends in the error.
        why = "; ".join(constraint_violations(block_size, spec, layout, num_blocks))
        window = range(block_size + 1, block_size + spec.alignment_bytes + 1)
        candidates = spec.allowed_block_sizes or window
        fitting = [
            c
            for c in sorted(candidates)
            if c > block_size and not constraint_violations(c, spec, layout, num_blocks)
        ]
        if not fitting:
            raise UsageError(f"no block size satisfies backend {backend}: {why}")
        rewrites.append((block_size, fitting[0], why))
        block_size = fitting[0]
    return BlockSizeResolution(block_size, backend, rewrites)
