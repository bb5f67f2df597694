"""The first article's thought experiment: one MLA model, each framework's page for it.

Each framework asks for its own page (its policy's default) and its MLA kernel's rule rewrites
it (``constraints.resolve_block_size``, the same rule table the plan prices): vLLM's 16 becomes
FlashMLA's 64, SGLang keeps its page of 1 on its default MLA backends (FlashInfer, Triton) and
is rewritten to 64 like vLLM with FlashMLA, TensorRT-LLM asks 64 of its 32/64 MLA kernels,
DeepInfer fixes 128 tokens of its compressed (FP4/MXFP8) records, and pagedkv's Triton MLA
kernel takes any page (its tile is not the page). Block bytes come from the one layout
(``pages/layout.py``), at the plan's KV dtype or the framework's own. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pagedkv.pages.layout import KVLayout
from pagedkv.planner.constraints import resolve_block_size

if TYPE_CHECKING:
    from rich.console import Console


@dataclass(frozen=True)
class Framework:
    """One framework serving an MLA model: the page it asks for (None: its kernel's default),
    the kernel whose rule applies (``constraints.BACKENDS``), its own KV dtype (None: the
    plan's)."""

    name: str
    backend: str
    requested: int | None
    kv_dtype: str | None = None


MLA_FRAMEWORKS = (
    Framework("vLLM + FlashMLA", "flashmla", 16),
    Framework("SGLang (FlashInfer/Triton MLA)", "flashinfer-mla", 1),
    Framework("SGLang + FlashMLA", "flashmla", 1),
    Framework("TensorRT-LLM", "trtllm-mla", 64),
    Framework("DeepInfer (MXFP8 records)", "deepinfer", 128, "mxfp8"),
    Framework("DeepInfer (FP4 records)", "deepinfer", 128, "fp4"),
    Framework("pagedkv (Triton MLA)", "triton", None),
)


@dataclass(frozen=True)
class FrameworkPage:
    framework: str
    block_size: int
    why: str  # the rewrites, or the kernel's own note
    kv_dtype: str
    layer_block_bytes: int
    block_bytes: int
    pool_tokens: int | None  # tokens a pool of the plan's bytes holds in whole blocks


def framework_pages(layout: KVLayout, pool_bytes: int | None = None) -> list[FrameworkPage]:
    """Each framework's page for ``layout`` (an MLA model's)."""
    pages = []
    for fw in MLA_FRAMEWORKS:
        at = layout if fw.kv_dtype is None else replace(layout, kv_dtype=fw.kv_dtype)
        resolution = resolve_block_size(fw.requested, fw.backend, at)
        block_size = resolution.block_size
        why = "; ".join(
            f"{'-' if a is None else a} -> {b}: {reason}" for a, b, reason in resolution.rewrites
        )
        block_bytes = at.block_bytes(block_size)
        tokens = None if pool_bytes is None else pool_bytes // block_bytes * block_size
        pages.append(
            FrameworkPage(
                fw.name,
                block_size,
                why or f"{fw.requested} accepted",
                at.kv_dtype,
                at.layer_block_bytes(block_size),
                block_bytes,
                tokens,
            )
        )
    return pages


def pages_to_json(pages: list[FrameworkPage]) -> list[dict[str, Any]]:
    return [p.__dict__.copy() for p in pages]


def render_pages(layout: KVLayout, pages: list[FrameworkPage], console: Console) -> None:
    """The table: page, bytes of one layer's block and of the whole block, why."""
    from rich.table import Table

    table = Table(title=f"Each framework's page for {layout.name} (MLA, KiB = 1024 B)")
    for column in ("framework", "page", "KV dtype", "layer block KiB", "block KiB"):
        table.add_column(column, justify="left" if column == "framework" else "right")
    with_pool = pages and pages[0].pool_tokens is not None
    if with_pool:
        table.add_column("pool tokens", justify="right")
    table.add_column("why")
    for p in pages:
        cells = [p.framework, str(p.block_size), p.kv_dtype]
        cells += [f"{p.layer_block_bytes / 1024:,.2f}", f"{p.block_bytes / 1024:,.1f}"]
        if with_pool:
            cells.append(f"{p.pool_tokens:,}")
        table.add_row(*cells, p.why)
    console.print(table)
