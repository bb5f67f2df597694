"""What pagedkv's Triton kernels accept, and why: the article's fourth ledger as a property of
code we ship. Torch-free: the kernels (``model/triton/``) check their inputs against these rules,
and the planner's ``triton`` backend reads its allowed block sizes from them; neither keeps a
copy of the numbers.

A kernel program loads one KV block as one tile, ``tl.arange(0, block_size)`` rows of
``tl.arange(0, head_dim)`` columns, and multiplies it with ``tl.dot``. Three facts of Triton
follow:

- ``tl.arange`` takes a power-of-two extent, so the block size and the head dim are powers of
  two (a padded, masked tile would waste up to half of every load);
- ``tl.dot`` needs at least 16 along each dimension of its operands (the tensor-core tile), so
  both are at least 16;
- a block tile of 256 x 256 or more no longer fits a program's registers and shared memory, so
  both are at most 256 (FlashAttention's largest head dim is 256 too).

The KV write and the block copy address single slots and whole blocks, so any size would do for
them; the engine's rule is the attention kernels'.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import UsageError

MIN_TILE = 16  # tl.dot's smallest operand dimension
MAX_TILE = 256  # the largest tile a program holds


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class TileRule:
    """The sizes one kernel accepts along a tiled dimension (block size or head dim)."""

    name: str  # "block size" / "head dim"
    minimum: int = MIN_TILE
    maximum: int = MAX_TILE
    power_of_two: bool = True  # the dimension is a tl.arange extent

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

    def allowed(self) -> tuple[int, ...]:
        """Every accepted value, ascending."""
        return tuple(v for v in range(self.minimum, self.maximum + 1) if self.problem(v) is None)


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


BLOCK = TileRule("block size")
HEAD = TileRule("head dim")
# Any size: these address slots and whole blocks, no tile spans a block.
ANY_BLOCK = TileRule("block size", minimum=1, maximum=1 << 30, power_of_two=False)

DECODE = KernelRule("triton paged decode", BLOCK, HEAD)
PREFILL = KernelRule("triton paged prefill", BLOCK, HEAD)
# A token's head is one tl.arange(0, head_dim) row.
KV_WRITE = KernelRule("triton KV write", ANY_BLOCK, TileRule("head dim", 1, MAX_TILE))
# A block is copied as flat chunks of its elements: any shape.
BLOCK_COPY = KernelRule(
    "triton block copy", ANY_BLOCK, TileRule("head dim", 1, 1 << 30, power_of_two=False)
)

# The kernels one engine step runs: the block size must satisfy all of them.
ENGINE_KERNELS = (DECODE, PREFILL, KV_WRITE, BLOCK_COPY)
DEFAULT_BLOCK_SIZE = 16  # vLLM's default; the smallest the tiles allow


def block_size_problems(block_size: int, head_dim: int | None = None) -> list[str]:
    """Why the Triton backend refuses ``block_size`` (and ``head_dim``, when given): each
    reason once, with the kernels that give it."""
    kernels_of: dict[str, list[str]] = {}
    for rule in ENGINE_KERNELS:
        for reason in rule.problems(block_size, head_dim):
            kernels_of.setdefault(reason, []).append(rule.kernel.removeprefix("triton "))
    return [f"{reason} in triton {', '.join(k)}" for reason, k in kernels_of.items()]


def allowed_block_sizes() -> tuple[int, ...]:
    """The block sizes every engine kernel accepts, ascending."""
    sizes = set(ENGINE_KERNELS[0].block_size.allowed())
    for rule in ENGINE_KERNELS[1:]:
        sizes &= {b for b in sizes if rule.block_size.problem(b) is None}
    return tuple(sorted(sizes))
