"""What pagedkv's Triton kernels accept, and why: the article's fourth ledger as a property of
code we ship. Torch-free: the kernels (``model/triton/``) check their inputs against these rules,
and the planner's ``triton`` backend reads them; neither keeps a copy of the numbers.

**The tile is not the page.** The attention kernels walk a sequence's context in tiles of ``T``
tokens, each token found through the block table (``table[t // B] * B + t % B``), and multiply
a tile with ``tl.dot``. Triton's facts bind the *tile*, not the block:

- ``tl.arange`` takes a power-of-two extent, so ``T`` and the head dim are powers of two;
- ``tl.dot`` needs at least 16 along each dimension of its operands (the tensor-core tile), so
  both are at least 16;
- a [T, head dim] tile of 256 x 256 or more no longer fits a program's registers and shared
  memory, so the head dim is at most 256 (FlashAttention's largest too) and ``T`` is sized by
  ``kv_tile`` below.

So every block size ``B >= 1`` is accepted, powers of two or not, up to one ``max_model_len``
region per sequence (the reserved policy): for ``B < T`` a tile gathers ``ceil(T / B)`` blocks,
for ``B >= T`` it is a slice of one. What is left of the constraint is the head dim. The KV
write and the block copy address single slots and whole blocks: any size for them too.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import UsageError

MIN_TILE = 16  # tl.dot's smallest operand dimension
MAX_TILE = 256  # the largest head dim a program holds as one tile row
# K/V tile bytes: K and V of ~3 pipelined tiles stay near 96 KiB of an H100/H200 SM's 228 KiB
# of shared memory; the same bound keeps a [G, T] score tile and the [T, D] operands in
# registers with 4-8 warps.
KV_TILE_BYTES = 16 * 1024
MAX_KV_TILE = 64  # tokens: longer tiles mask more of a short context's last tile for nothing


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def kv_tile(head_dim: int, element_bytes: int) -> int:
    """Tokens per K/V tile of the attention kernels: the largest power of two up to
    ``MAX_KV_TILE`` whose [T, head dim] tile fits ``KV_TILE_BYTES``, never under 16. bf16 or fp16
    with head dim 128: 64; fp32 with 128, or 16-bit with 256: 32; fp32 with 256: 16."""
    tile = MAX_KV_TILE
    while tile > MIN_TILE and tile * head_dim * element_bytes > KV_TILE_BYTES:
        tile //= 2
    return tile


@dataclass(frozen=True)
class TileRule:
    """The sizes one kernel accepts along a dimension (block size or head dim)."""

    name: str  # "block size" / "head dim"
    minimum: int = MIN_TILE
    maximum: int = MAX_TILE
    power_of_two: bool = True  # the dimension is a tl.arange extent
    why_any: str = ""  # for a rule that accepts every size: why (the planner prints it)

    def problem(self, value: int) -> str | None:
        """Why ``value`` is refused, or None when it is accepted."""
        if value < 1:
            return f"{self.name} {value} is not a positive size"
        if self.power_of_two and not _is_power_of_two(value):
            return f"{self.name} {value} is not a power of two (tl.arange needs one)"
        if value < self.minimum:
            return f"{self.name} {value} is under {self.minimum} (tl.dot's smallest tile)"
        if value > self.maximum:
            return f"{self.name} {value} is over {self.maximum} (the tile outgrows a program)"
        return None


@dataclass(frozen=True)
class KernelRule:
    """One kernel's contract on the page: its block sizes and head dims."""

    kernel: str
    block_size: TileRule
    head_dim: TileRule

    def problems(self, block_size: int, head_dim: int | None = None) -> list[str]:
        """Why this kernel refuses these sizes (empty: it accepts them)."""
        found = [self.block_size.problem(block_size)]
        if head_dim is not None:
            found.append(self.head_dim.problem(head_dim))
        return [p for p in found if p is not None]

    def check(self, block_size: int, head_dim: int) -> None:
        """``UsageError`` naming every refused size (the error a kernel raises at its edge)."""
        if found := self.problems(block_size, head_dim):
            raise UsageError(f"{self.kernel}: {'; '.join(found)}", "block_size")


HEAD = TileRule("head dim")
# Any size: the attention kernels gather tiles of T tokens through the table; the KV write
# addresses slots and the block copy whole blocks.
ANY_BLOCK = TileRule(
    "block size",
    minimum=1,
    maximum=1 << 40,
    power_of_two=False,
    why_any="tiles of T tokens are gathered through the block table, so the tile is not the page",
)

DECODE = KernelRule("triton paged decode", ANY_BLOCK, HEAD)
PREFILL = KernelRule("triton paged prefill", ANY_BLOCK, HEAD)
# A token's head is one tl.arange(0, head_dim) row.
KV_WRITE = KernelRule("triton KV write", ANY_BLOCK, TileRule("head dim", 1, MAX_TILE))
# A block is copied as flat chunks of its elements: any shape.
BLOCK_COPY = KernelRule(
    "triton block copy", ANY_BLOCK, TileRule("head dim", 1, 1 << 30, power_of_two=False)
)

# MLA's latent records (``model/triton/mla_decode.py``): any rank and rope width (each part of
# a record is padded to a power of two >= 16 and masked), up to a [heads, rank] fp32
# accumulator a program holds.
MLA_DECODE = KernelRule(
    "triton MLA decode",
    ANY_BLOCK,
    TileRule("latent rank", minimum=1, maximum=1024, power_of_two=False),
)
MLA_MAX_HEAD_BLOCK = 32  # query heads per program: a [32, 512] fp32 accumulator


def mla_head_block(num_heads: int) -> int:
    """Query heads per MLA decode program: all of them up to ``MLA_MAX_HEAD_BLOCK`` (one read
    of the records per sequence), a power of two, at least tl.dot's 16."""
    block = MIN_TILE
    while block < min(num_heads, MLA_MAX_HEAD_BLOCK):
        block *= 2
    return block


def mla_programs(num_heads: int) -> int:
    """MLA decode programs per sequence (blocks of ``mla_head_block`` heads): what the split
    rule (``triton_splits.decode_splits``) counts where MHA counts KV heads."""
    return -(-num_heads // mla_head_block(num_heads))


def mla_tile(record_width: int, element_bytes: int) -> int:
    """Tokens per latent tile of the MLA decode kernel: ``kv_tile``'s rule with both budgets,
    K's and V's, since one tile of records is both (DeepSeek's 576 values in bf16: 16)."""
    tile = MAX_KV_TILE
    while tile > MIN_TILE and tile * record_width * element_bytes > 2 * KV_TILE_BYTES:
        tile //= 2
    return tile


# The kernels one engine step runs: the block size must satisfy all of them.
ENGINE_KERNELS = (DECODE, PREFILL, KV_WRITE, BLOCK_COPY)
DEFAULT_BLOCK_SIZE = 16  # vLLM's default; no longer the kernels' smallest


def block_size_problems(block_size: int, head_dim: int | None = None) -> list[str]:
    """Why the Triton backend refuses ``block_size`` (and ``head_dim``, when given): each
    reason once, with the kernels that give it."""
    kernels_of: dict[str, list[str]] = {}
    for rule in ENGINE_KERNELS:
        for reason in rule.problems(block_size, head_dim):
            kernels_of.setdefault(reason, []).append(rule.kernel.removeprefix("triton "))
    return [f"{reason} in triton {', '.join(k)}" for reason, k in kernels_of.items()]


def block_size_note() -> str:
    """Why the backend takes every block size, in the kernels' own words (the planner's line)."""
    return f"any block size >= 1: {ANY_BLOCK.why_any}"
