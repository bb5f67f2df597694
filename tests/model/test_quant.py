"""Weight-only quantized projections (model/quant.py) and the torch GGUF block decoders.

References are computed here by hand from the block layouts / quantization formulas, or by
the ``gguf`` package's own numpy dequantizer, never by the code under test.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pagedkv.engine import EngineConfig
from pagedkv.errors import UsageError
from pagedkv.model import native
from pagedkv.model.gguf_quants import dequantize_q4_1, dequantize_q8_0
from pagedkv.model.native.backend import chain_of
from pagedkv.model.native.quant import NativeQuantProjection
from pagedkv.model.projection import ProjectionBase
from pagedkv.model.quant import (
    QuantizingFactory,
    QuantProjection,
    quantize_int4,
    quantize_int8,
)


def _q4_1_bytes(rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random Q4_1 blocks and the weights they encode (d * q + m), computed independently."""
    rng = np.random.default_rng(seed)
    groups = rows * cols // 32
    d = rng.uniform(0.01, 0.1, groups).astype(np.float16)
    m = rng.uniform(-1, 0, groups).astype(np.float16)
    q = rng.integers(0, 16, (groups, 32))
    q[:, 0], q[:, 1] = 0, 15  # llama.cpp's Q4_1 maps each group's min to 0 and max to 15
    packed = (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2),
                             packed], axis=1)  # fmt: skip
    weights = (d.astype(np.float32)[:, None] * q + m.astype(np.float32)[:, None]).astype(np.float32)
    return blocks.reshape(rows, -1), torch.from_numpy(weights.reshape(rows, cols))


def test_q4_1_and_q8_0_decoders_match_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    raw, expected = _q4_1_bytes(8, 64)
    ours = dequantize_q4_1(raw, 8)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(8, 64)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs)))
    assert torch.allclose(ours, expected)
    rng = np.random.default_rng(1)
    d = rng.uniform(0.01, 0.1, 16).astype(np.float16).view(np.uint8).reshape(16, 2)
    q8 = rng.integers(-127, 128, (16, 32)).astype(np.int8).view(np.uint8)
    raw8 = np.concatenate([d, q8], axis=1).reshape(4, -1)
    theirs8 = gguf.quants.dequantize(raw8, gguf.GGMLQuantizationType.Q8_0).reshape(4, 128)
    assert torch.equal(dequantize_q8_0(raw8, 4), torch.from_numpy(np.ascontiguousarray(theirs8)))


def _weights_of(module: torch.nn.Module, in_features: int) -> torch.Tensor:
    """The ``[out, in]`` matrix a projection applies, read back through an identity input."""
    return module(torch.eye(in_features)).t()


def test_int4_requantization_of_q4_1_weights_is_lossless():
    """Q4_1's groups (scale, minimum, 32 weights) are exactly the int4 kernel's groups."""
    _, weight = _q4_1_bytes(64, 128)
    tensors = quantize_int4(weight)
    module = QuantProjection("int4", 128, 64, tensors, torch.float32, None)
    assert (_weights_of(module, 128) - weight).abs().max() < 1e-5


def test_int8_error_stays_within_half_a_step_per_weight():
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_int8(weight)
    module = QuantProjection("int8", 96, 48, (q, scale), torch.float32, None)
    err = (_weights_of(module, 96) - weight).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()
    assert err.max() > 0  # really quantized


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_factory_builds_projections_that_compute_the_weights_and_reports_each_shape(kind):
    _, weight = _q4_1_bytes(96, 64, seed=2)
    bias = torch.linspace(-1, 1, 96)
    factory = QuantizingFactory(kind, torch.float32)
    modules = [factory(f"p{i}", weight, bias) for i in range(2)]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    want = x @ weight.t() + bias
    for module in modules:
        assert isinstance(module, ProjectionBase)
        # bf16 activations (when chosen) round x to 8 bits of mantissa: a loose bound.
        assert (module(x) - want).abs().max() < 0.05 * want.abs().max()
    report = factory.report()
    assert f"weights {kind}" in report and "[64 x 96] x2:" in report
    assert len(factory.choices) == 1  # one choice per distinct shape


@pytest.mark.parametrize(
    ("option", "native_loads", "want"),
    [
        ("int4", True, "native"),  # the exact path wherever pagedkv's kernels load
        ("int4", False, "float32"),  # else torch's int kernel, the model's own activations
        ("int8", True, "native"),
        ("int4-bf16", True, "bfloat16"),  # the named bf16 choice, whatever else loads
        ("int8-bf16", False, "bfloat16"),
    ],
)
def test_the_kernel_is_the_rules_never_a_clocks(option, native_loads, want, monkeypatch):
    if native_loads and native.kernels() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    if not native_loads:
        monkeypatch.setattr(native, "_state", {"off": True})
    _, weight = _q4_1_bytes(64, 96, seed=4)
    # However slow torch's int kernel is, the rule's choice is what every factory builds
    # (issue 28: a timing at load changed one shape's kernel between starts, and the tokens).
    monkeypatch.setattr(QuantProjection, "forward", _slowed(QuantProjection.forward))
    choices = set()
    for _ in range(5):
        factory = QuantizingFactory(option, torch.float32)
        factory("layers.0.mlp.down_proj", weight, None)
        choices |= set(factory.choices.values())
    assert choices == {want}
    assert factory.choices[(option[:4], 96, 64)] == want
    # Input rows that are no multiple of 32 fit no block or group: the float path.
    factory("layers.0.odd", torch.randn(8, 40), None)
    assert factory.choices[(option[:4], 40, 8)] == "plain"


def test_weights_option_is_checked_at_the_edge():
    with pytest.raises(UsageError) as err:
        EngineConfig(weights="int3")
    assert err.value.param == "weights" and "int3" in str(err.value)


def _slowed(forward):
    def slower(self, x):
        time.sleep(0.002)
        return forward(self, x)

    return slower


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_where_no_int_kernel_runs_the_float_path_is_kept_exactly(kind, tmp_path, monkeypatch):
    """Without pagedkv's kernels and without torch's int kernel (a CPU build that lacks it),
    the rule keeps what ``weights="float"`` builds, so the load computes bit for bit what the
    float load computes, on the same projection classes."""
    from pagedkv.model import load_model
    from tests.model.helpers import Chunk, run_steps
    from tests.model.tiny import make_tiny_model

    def missing(self, x):
        raise RuntimeError("this CPU build has no int kernel")

    monkeypatch.setattr(native, "_state", {"off": True})
    monkeypatch.setattr(QuantProjection, "forward", missing)
    make_tiny_model("llama", tmp_path)
    _, reference, _ = load_model(tmp_path, progress=False)
    _, model, _ = load_model(tmp_path, progress=False, weights=kind)
    kinds = [type(m) for m in model.modules() if isinstance(m, ProjectionBase)]
    assert kinds == [type(m) for m in reference.modules() if isinstance(m, ProjectionBase)]
    assert not {QuantProjection, NativeQuantProjection} & set(kinds) and len(kinds) > 1
    assert [chain_of(layer) is not None for layer in model.layers] == [
        chain_of(layer) is not None for layer in reference.layers
    ]
    assert all(line.endswith(": fp32") for line in model.weights_report.splitlines()[1:])
    ids = [[(7 * i + 3) % 250 + 5 for i in range(20)], [(11 * i + 1) % 250 + 5 for i in range(9)]]
    steps = [[Chunk(0, 0, 16), Chunk(1, 0, 8)], [Chunk(0, 16, 17), Chunk(1, 8, 9)]]  # a decode
    got = run_steps(model, ids, steps, block_size=16, max_len=32)
    want = run_steps(reference, ids, steps, block_size=16, max_len=32)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
