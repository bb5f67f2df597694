"""Weight-only quantized projections (``weights="int4"|"int8"``), the kernel chosen per shape
at load among pagedkv's block kernels and torch's int kernels.

Candidates for each projection:
- "native" (``native_quant.py``): GGUF's Q4_1 blocks for int4 (Q8_0 for int8 and for int4's
  lm_head) on pagedkv's kernels, fp32 activations. On weights decoded from such blocks (a
  Q4_1 GGUF) the products are the fp32 kernel's, bit for bit.
- "float32" / "bfloat16": torch's ``_weight_int4pack_mm_for_cpu`` (group-wise asymmetric int4,
  32 weights with a scale and a minimum, Q4_1's numbers; it computes ``(q - 8) * scale +
  zero``, so zero = minimum + 8 * scale) or ``_weight_int8pack_mm`` (int8 per output
  channel), with activations in that dtype.
- "plain": what ``weights="float"`` builds (pagedkv's fp32 kernel where it loads, else torch's
  matmul), kept only where it is clearly faster (``PLAIN_MARGIN``).

Each distinct shape is timed at one row (batch-1 decode, what the option is for), the
candidates taking turns, each call with its weights evicted from the cache as a decode step
streams them. On this AVX2 CPU the native blocks win every shape; on an AVX-512 machine
torch's bf16-activation kernels beat torch's fp32 matmul by 2-5x at one row, and with fp32
activations were 3-6x *slower*: the order differs by CPU, hence the measurement. The choices
are printed at start-up. fp32 stays the default and the reference of the greedy-equality
tests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pagedkv.model.native_projection import native_factory
from pagedkv.model.native_quant import NativeQuantProjection
from pagedkv.model.projection import ProjectionBase, projection_from_pieces

GROUP = 32
NATIVE_FORMATS = {"int4": "q4_1", "int8": "q8_0"}  # --weights -> the GGUF blocks kept natively
# The float path is kept for a shape only where it beats the int kernel by more than this:
# the user asked for quantized weights, and a near tie at one row (timings move 10-20 % run to
# run here) must not flip what a load keeps, nor its memory.
PLAIN_MARGIN = 1.1


class QuantProjection(ProjectionBase):
    """``x @ W.T (+ bias)`` with W held quantized; output in ``x``'s dtype."""

    def __init__(self, kind: str, in_features: int, out_features: int, tensors, act, bias):
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.act_dtype = act
        # int4: packed uint8 and [groups, N, 2] scale/zero; int8: int8 [N, K] and scales [N]
        self.register_buffer("weight_q", tensors[0])
        self.register_buffer("scales", tensors[1])
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xa = x.to(self.act_dtype)
        if self.kind == "int4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.weight_q, GROUP, self.scales)
        else:
            out = torch._weight_int8pack_mm(xa, self.weight_q, self.scales)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def describe(self) -> str:
        return f"{self.kind} kernel, {str(self.act_dtype).removeprefix('torch.')} activations"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight_q, self.scales))


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scales_and_zeros)`` of fp32 ``[N, K]`` (K a multiple of 32)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-12)  # a constant group: any scale, q = 0
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
    scales = torch.stack((scale, low + 8 * scale), dim=-1).transpose(0, 1).contiguous()
    return packed, scales


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [N, K], fp32 scales [N])``, symmetric per output channel."""
    scale = (weight.float().abs().amax(-1) / 127).clamp_min(1e-12)
    q = torch.round(weight.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def pick_kernel(timings_us: dict[str, float]) -> str:
    """The fastest quantized candidate ("native", "float32", "bfloat16"), or "plain" where the
    float path beats it by more than ``PLAIN_MARGIN`` (or no quantized candidate ran)."""
    ints = [c for c in timings_us if c != "plain"]
    if not ints:
        return "plain"
    best = min(ints, key=timings_us.__getitem__)
    return "plain" if timings_us["plain"] * PLAIN_MARGIN < timings_us[best] else best


def largest_cache_bytes() -> int:
    """The CPU's largest cache (Linux sysfs ``cpu0/cache/index*/size``), 32 MiB if unreadable."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


def _time_us(
    candidates: dict[str, Callable[[], object]], evict: Callable[[], object], reps: int = 7
) -> dict[str, float]:
    """Best microseconds of each candidate over ``reps`` rounds, the candidates taking turns
    (so that a stall of this shared machine hits them alike), each call after ``evict()``
    pushed its weights out of the cache: a decode step streams every weight from memory (538
    MB for the embedded model), and one matrix timed hot (a few MB, in L3) hides exactly the
    bytes that int4 saves. Timed hot, fp32 won every shape here; cold, int4 did, and a whole
    decode step agreed (bench_weights.py). A candidate whose warm-up call raises
    ``RuntimeError`` (a kernel this CPU build lacks) is left out."""
    runnable = {}
    for name, fn in candidates.items():
        with contextlib.suppress(RuntimeError):
            fn()
            runnable[name] = fn
    best = dict.fromkeys(runnable, float("inf"))
    for _ in range(reps):
        for name, fn in runnable.items():
            evict()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: seconds * 1e6 for name, seconds in best.items()}


class QuantizingFactory:
    """A ``ProjectionFactory`` for ``llama.load_weights``: quantizes each projection and picks
    its kernel by a one-row timing per distinct shape (cached). ``report()`` says what won.

    Candidates: "native" (GGUF blocks on pagedkv's kernels, ``native_quant.py``: Q4_1 for
    int4, Q8_0 for int8; fp32 models where the kernels load), torch's int kernel with
    "float32" or "bfloat16" activations, and "plain" (what ``weights="float"`` builds)."""

    def __init__(
        self,
        kind: str,
        dtype: torch.dtype,
        threads: int | None = None,
        force: str | None = None,
    ) -> None:
        """``threads``: what the kernels will run with (the loader decodes on one thread).
        ``force``: None measures; "native", "float32" or "bfloat16" takes that int kernel for
        every shape where it runs, however it times (the quality tests: on a CPU where another
        candidate wins, the one under test would otherwise never run)."""
        if kind not in ("int8", "int4"):
            raise ValueError(f"quantized weights are int8 or int4, not {kind!r}")
        if force not in (None, "native", "float32", "bfloat16"):
            raise ValueError(f"force is native, float32 or bfloat16, not {force!r}")
        self.kind, self.dtype, self.force = kind, dtype, force
        self._make_native = native_factory() if dtype == torch.float32 else None
        self.threads = threads or torch.get_num_threads()
        # (kind, in, out) -> (the winner, microseconds per candidate at one row)
        self.choices: dict[tuple[str, int, int], tuple[str, dict[str, float]]] = {}
        self.counts: dict[tuple[str, int, int], int] = {}

    def __call__(
        self, name: str, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> ProjectionBase:
        n, k = weight.shape
        # The output projection stays 8-bit, as GGUF files keep it (the embedded model's
        # token_embd is Q8_0): int4 there cost 15 % perplexity, int8 nothing measurable.
        kind = "int8" if name == "lm_head" else self.kind
        if kind == "int4" and k % GROUP:
            return self._build("plain", kind, name, weight, bias)
        key = (kind, k, n)
        self.counts[key] = self.counts.get(key, 0) + 1
        if key in self.choices:
            return self._build(self.choices[key][0], kind, name, weight, bias)
        names = ["plain", "float32", "bfloat16"]
        if self._make_native is not None and k % GROUP == 0:
            names.insert(1, "native")
        torch_tensors = quantize_int4(weight) if kind == "int4" else quantize_int8(weight)
        built = {c: self._build(c, kind, name, weight, bias, torch_tensors) for c in names}
        timings = self._time(built, k)
        choice = self.force if self.force in timings else pick_kernel(timings)
        self.choices[key] = (choice, timings)
        return built[choice]

    def _build(
        self, choice: str, kind: str, name: str, weight, bias, torch_tensors=None
    ) -> ProjectionBase:
        """The projection of ``choice`` for ``weight``; ``torch_tensors``: its torch int
        quantization when already made (shared by the two activation dtypes)."""
        if choice == "plain":  # what weights="float" builds for this tensor
            biases = [] if bias is None else [bias]
            return projection_from_pieces(name, [weight], biases, self.dtype, self._make_native)
        if choice == "native":
            return NativeQuantProjection(NATIVE_FORMATS[kind], weight, bias)
        n, k = weight.shape
        act = getattr(torch, choice)
        tensors = torch_tensors
        if tensors is None:
            tensors = quantize_int4(weight) if kind == "int4" else quantize_int8(weight)
        b = None if bias is None else nn.Parameter(bias.to(self.dtype), requires_grad=False)
        return QuantProjection(kind, k, n, (tensors[0], tensors[1].to(act)), act, b)

    def _time(self, built: dict[str, ProjectionBase], k: int) -> dict[str, float]:
        x = torch.randn(1, k, dtype=self.dtype)
        flood = torch.ones(2 * largest_cache_bytes() // 4)  # read through: evicts the weights
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return _time_us({c: lambda m=m: m(x) for c, m in built.items()}, flood.sum)
        finally:
            torch.set_num_threads(before)

    def report(self) -> str:
        """One line per shape: ``[in x out] xN: <kernel> (us at 1 row per candidate)``."""
        cpu = torch.backends.cpu.get_cpu_capability()
        lines = [f"weights {self.kind}, kernel per shape timed at 1 row, cache cold (cpu {cpu}):"]
        for (kind, k, n), (choice, timings) in self.choices.items():
            what = {
                "plain": "fp32",
                "native": f"{NATIVE_FORMATS[kind]} blocks, pagedkv's kernel",
            }.get(choice, f"{kind} kernel, {choice} activations")
            times = ", ".join(f"{c} {us:.0f} us" for c, us in timings.items())
            lines.append(f"  [{k} x {n}] x{self.counts[(kind, k, n)]}: {what} ({times})")
        return "\n".join(lines)
