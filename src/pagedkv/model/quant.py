"""Weight-only quantized projections (``--weights int4|int8|int4-bf16|int8-bf16``), the
kernel of each projection decided by a rule at load, never by a clock.

The kernels:
- "native" (``native/quant.py``): GGUF's Q4_1 blocks for int4 (Q8_0 for int8 and for int4's
  lm_head) on pagedkv's kernels, fp32 activations. On weights decoded from such blocks (a
  Q4_1 GGUF) the products are the fp32 kernel's, bit for bit.
- "float32" / "bfloat16": torch's ``_weight_int4pack_mm_for_cpu`` (group-wise asymmetric int4,
  32 weights with a scale and a minimum, Q4_1's numbers; it computes ``(q - 8) * scale +
  zero``, so zero = minimum + 8 * scale) or ``_weight_int8pack_mm`` (int8 per output
  channel), with activations in that dtype.
- "plain": what ``weights="float"`` builds, where no int kernel applies (an int4 input width
  that is no multiple of 32, or a CPU build without torch's int kernels).

The rule: ``int4`` and ``int8`` take the native blocks wherever pagedkv's kernels load (an fp32
model, every CPU they build on: the exact path), else torch's int kernel with the model's own
activations. ``int4-bf16`` and ``int8-bf16`` take torch's int kernel with bf16 activations for
every shape: faster on CPUs with AVX512-BF16 or AMX, but rounding differently, so a separate,
named choice. An earlier load timed the candidates per shape and kept the fastest: on an
AVX-512 CPU the choice for one shape changed from one start to the next, and with it the
tokens (issue 28). Speed is measured in ``benchmarks/bench_weights.py`` instead.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model import native
from pagedkv.model.native.projection import native_factory
from pagedkv.model.native.quant import NativeQuantProjection
from pagedkv.model.projection import ProjectionBase, projection_from_pieces

GROUP = 32
TORCH_INT4_OUTPUTS = 16  # _convert_weight_to_int4pack_for_cpu: N a multiple of 16
NATIVE_FORMATS = {"int4": "q4_1", "int8": "q8_0"}  # --weights -> the GGUF blocks kept natively
# --weights -> (bits, the int kernel's activations; None = the rule: native, else the model's)
WEIGHT_OPTIONS: dict[str, tuple[str, str | None]] = {
    "int4": ("int4", None),
    "int8": ("int8", None),
    "int4-bf16": ("int4", "bfloat16"),
    "int8-bf16": ("int8", "bfloat16"),
}


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


class QuantizingFactory:
    """A ``ProjectionFactory`` for ``CausalLM.load_weights`` (``weights.py``): quantizes each projection and builds
    it on the kernel the module docstring's rule names (the same on every start).
    ``report()`` says what runs, per shape."""

    def __init__(self, option: str, dtype: torch.dtype, force: str | None = None) -> None:
        """``option``: a ``WEIGHT_OPTIONS`` name. ``force``: "native", "float32" or
        "bfloat16" takes that kernel for every shape where it applies (the quality tests and
        benchmarks compare kernels on one CPU)."""
        if option not in WEIGHT_OPTIONS:
            raise ValueError(f"quantized weights are one of {list(WEIGHT_OPTIONS)}, not {option!r}")
        if force not in (None, "native", "float32", "bfloat16"):
            raise ValueError(f"force is native, float32 or bfloat16, not {force!r}")
        self.option, self.dtype = option, dtype
        self.kind, activations = WEIGHT_OPTIONS[option]
        self.force = force or activations
        self._make_native = native_factory() if dtype == torch.float32 else None
        self._torch_int_runs: dict[str, bool] = {}  # kind -> whether this build has the kernel
        self.choices: dict[tuple[str, int, int], str] = {}  # (kind, in, out) -> kernel
        self.counts: dict[tuple[str, int, int], int] = {}

    def __call__(
        self, name: str, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> ProjectionBase:
        n, k = weight.shape
        # The output projection stays 8-bit, as GGUF files keep it (the embedded model's
        # token_embd is Q8_0): int4 there cost 15 % perplexity, int8 nothing measurable.
        kind = "int8" if name == "lm_head" else self.kind
        key = (kind, k, n)
        self.counts[key] = self.counts.get(key, 0) + 1
        choice = self.choices.get(key) or self._rule(kind, k, n)
        self.choices[key] = choice
        return self._build(choice, kind, name, weight, bias)

    def _rule(self, kind: str, k: int, n: int) -> str:
        """The kernel of a ``kind`` projection of ``k`` inputs and ``n`` outputs (see the
        module docstring)."""
        if k % GROUP:  # neither Q4_1/Q8_0 blocks nor torch's int4 groups fit the rows
            return "plain"
        native = self._make_native is not None
        if self.force == "native" or (self.force is None and native):
            return "native" if native else "plain"
        activations = self.force or str(self.dtype).removeprefix("torch.")
        # torch packs int4 weights by 16 output channels.
        fits = kind == "int8" or n % TORCH_INT4_OUTPUTS == 0
        return activations if fits and self._torch_int_kernel_runs(kind) else "plain"

    def _torch_int_kernel_runs(self, kind: str) -> bool:
        """Whether this torch build has its int ``kind`` CPU kernel (one tiny call, once)."""
        if kind not in self._torch_int_runs:
            weight = torch.ones(TORCH_INT4_OUTPUTS, 2 * GROUP)
            module = self._build("bfloat16", kind, "probe", weight, None)
            try:
                module(torch.ones(1, 2 * GROUP))
                self._torch_int_runs[kind] = True
            except RuntimeError:
                self._torch_int_runs[kind] = False
        return self._torch_int_runs[kind]

    def _build(self, choice: str, kind: str, name: str, weight, bias) -> ProjectionBase:
        """The projection of ``choice`` for ``weight``."""
        if choice == "plain":  # what weights="float" builds for this tensor
            biases = [] if bias is None else [bias]
            return projection_from_pieces(name, [weight], biases, self.dtype, self._make_native)
        if choice == "native":
            return NativeQuantProjection(NATIVE_FORMATS[kind], weight, bias)
        n, k = weight.shape
        act = getattr(torch, choice)
        tensors = quantize_int4(weight) if kind == "int4" else quantize_int8(weight)
        b = None if bias is None else nn.Parameter(bias.to(self.dtype), requires_grad=False)
        return QuantProjection(kind, k, n, (tensors[0], tensors[1].to(act)), act, b)

    def report(self) -> str:
        """One line per shape: ``[in x out] xN: <kernel>``."""
        cpu = torch.backends.cpu.get_cpu_capability()
        lines = [f"weights {self.option}, kernel per shape by rule (cpu {cpu}):"]
        for (kind, k, n), choice in self.choices.items():
            what = {
                "plain": "fp32" if self.dtype == torch.float32 else "bf16, unquantized",
                "native": f"{NATIVE_FORMATS[kind]} blocks, pagedkv's {native.isa().upper()} kernel",
            }.get(choice, f"{kind} kernel, {choice} activations")
            lines.append(f"  [{k} x {n}] x{self.counts[(kind, k, n)]}: {what}")
        return "\n".join(lines)
