"""pagedkv's attention backends, one entry each: the one table the engine, the flags and the
planner read. Torch-free, so ``--attention-backend`` is checked before torch loads and the
planner's ``--backend`` prices the same rules the engine runs.

An entry says what a backend is (``name``, in the one vocabulary ``native | torch-sdpa |
triton``), where it runs (``devices``; the first backend listing a device type in
``default_on`` is its default), which block sizes and head dims it accepts and why
(``problems``, ``note``), which KV records it reads (``layouts``), whether a decode step can be
recorded as a CUDA graph (``cuda_graphs``), whether the simulator has a clock fitted to
pagedkv's engine on it (``engine_clock``), and where its factory lives (``factory``: a
``module:attribute`` the model layer imports, called with the model and the device). No
backend name is compared anywhere else.

All three read K/V through the block table one token (or one tile of tokens) at a time, so none
constrains the block size: the page is a storage unit, not a compute unit, on every path. Only
the Triton kernels constrain the head dim (a ``tl.arange`` extent: ``triton_rules.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.pages import triton_rules


def any_block_size(block_size: int, head_dim: int | None = None) -> list[str]:
    """Every block size >= 1 and every head dim."""
    return [] if block_size >= 1 else [f"block size {block_size} is not a positive size"]


@dataclass(frozen=True)
class BackendRule:
    """One backend (module docstring). ``problems(block_size, head_dim or None)``: why it
    refuses them, in its own words (empty: accepted); ``loops_over_tiles``: its loop count is
    tiles of the context, not blocks (the planner's time ledger says so instead of counting
    ceil(L / B))."""

    name: str
    note: str
    devices: tuple[str, ...]
    factory: str
    default_on: tuple[str, ...] = ()
    cuda_graphs: bool = False
    cpu_note: str = ""  # said at start-up when it runs on the CPU
    engine_clock: bool = False  # a GPU clock fitted to pagedkv's engine on it (pagedkv-triton)
    layouts: tuple[str, ...] = ("mha",)
    problems: Callable[[int, int | None], list[str]] = any_block_size
    loops_over_tiles: bool = False


NATIVE = BackendRule(
    "native",
    "pagedkv's C kernels (CPU): keys and values read through the block table in runs of 32 "
    "positions, whatever the block: any B >= 1",
    devices=("cpu",),
    factory="pagedkv.model.native.backend:NativeBackend",
    default_on=("cpu",),
    layouts=("mha", "mla"),  # MLA: the same kernel reads the latent record as one head
    loops_over_tiles=True,
)
TORCH_SDPA = BackendRule(
    "torch-sdpa",
    "pagedkv paged attention in torch (K/V gathered by slot, then SDPA; any device): any B >= 1",
    devices=("cpu", "cuda"),
    factory="pagedkv.model.torch_backend:TorchBackend",
    layouts=("mha", "mla"),
)
TRITON = BackendRule(
    "triton",
    f"pagedkv's Triton kernels (GPU): {triton_rules.block_size_note()}; MLA latent records "
    "too, at any B (FlashMLA's tile is its page and forces 64; this kernel's tile is not)",
    devices=("cuda", "cpu"),  # the CPU: Triton's interpreter, for tests
    factory="pagedkv.model.triton.backend:TritonBackend",
    default_on=("cuda",),
    cuda_graphs=True,
    cpu_note="Triton's interpreter on the CPU: for tests, slow",
    engine_clock=True,
    layouts=("mha", "mla"),
    problems=triton_rules.block_size_problems,
    loops_over_tiles=True,
)
RULES = {rule.name: rule for rule in (NATIVE, TORCH_SDPA, TRITON)}
# Names of an earlier vocabulary, per device type: what each one became.
ALIASES = {"torch": {"cpu": "native", "cuda": "torch-sdpa"}}


def check_backend_name(name: str | None) -> None:
    """``UsageError`` naming ``attention_backend`` unless None (the device's default), a
    backend of the table or an alias."""
    if name is not None and name not in RULES and name not in ALIASES:
        raise UsageError(
            f"attention backend must be one of {', '.join(RULES)}, got {name!r}",
            "attention_backend",
        )


def resolve_backend(name: str | None, device_type: str) -> tuple[BackendRule, str]:
    """The backend that runs on ``device_type`` for ``name`` (None: the device's default), and
    a note when a name was rewritten ("" otherwise). ``UsageError`` when it cannot run there."""
    check_backend_name(name)
    note = ""
    if name in ALIASES:
        became = ALIASES[name][device_type]
        note = f"--attention-backend {name} is now called {became}"
        name = became
    if name is None:
        name = next(r.name for r in RULES.values() if device_type in r.default_on)
    rule = RULES[name]
    if device_type not in rule.devices:
        raise UsageError(
            f"attention backend {name} runs on {' or '.join(rule.devices)}, not {device_type}",
            "attention_backend",
        )
    return rule, note
