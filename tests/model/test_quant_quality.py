"""How far the quantized weight options move the embedded model from its fp32 reference, on a
held text (teacher-forced): mean |logit error|, perplexity, top-1 agreement. Run with ``-s`` to
see the numbers (docs/latency.md quotes them).

The embedded file is Q4_1 already, so int4 re-packs the same integers (lossless, see
test_quant.py). On torch's int kernels what remains is the bf16 activations they run with; on
pagedkv's block kernels (``native``) nothing remains: the logits are fp32's, bit for bit. int8
re-quantizes the Q4_1 values, per output channel on torch's kernel, as Q8_0 blocks on
pagedkv's.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import load_model, native
from tests.model.helpers import Chunk, run_steps

pytestmark = pytest.mark.slow

HELD_TEXT = (
    "The lighthouse stood on a spit of black rock at the mouth of the harbour. Every night for "
    "ninety years a keeper had climbed its one hundred and twelve steps to trim the wick, wind "
    "the clockwork that turned the lens, and write the weather in a leather-bound log. When the "
    "light was automated in 1974 the last keeper, a widower named Thomas Reid, refused to leave; "
    "the harbour board let him stay on as caretaker, and he kept the log for another decade."
)


def _teacher_forced(model, ids: list[int]) -> torch.Tensor:
    return run_steps(model, [ids], [[Chunk(0, 0, len(ids))]], block_size=16, max_len=len(ids))[0]


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    targets = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1], targets)
    return float(nll.exp())


@pytest.mark.parametrize("kind", ["int4-bf16", "int8-bf16", "int4", "int8"])
def test_quantized_weights_stay_close_to_fp32(embedded, kind):
    force = "bfloat16" if kind.endswith("-bf16") else "native"  # what the rule runs
    if force == "native" and native.kernels() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    _, reference, tokenizer = embedded
    ids = tokenizer.encode(HELD_TEXT)
    ref = _teacher_forced(reference, ids)
    _, model, _ = load_model(None, progress=False, weights=kind)
    got = _teacher_forced(model, ids)
    _measured_close(f"{kind} ({force})", got, ref, ids, exact=(kind, force) == ("int4", "native"))
    print(model.weights_report)


def _measured_close(label: str, got: torch.Tensor, ref: torch.Tensor, ids, exact=False) -> None:
    """Print the distance of ``got`` from the fp32 ``ref`` and assert it is small (or none)."""
    mean_err = float((got - ref).abs().mean())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    ppl_ref, ppl = _perplexity(ref, ids), _perplexity(got, ids)
    print(f"\n{label}: {len(ids)} tokens, mean |logit error| {mean_err:.4f} "
          f"(logit std {float(ref.std()):.2f}), top-1 agreement {agree:.3f}, "
          f"perplexity {ppl:.3f} vs fp32 {ppl_ref:.3f}")  # fmt: skip
    if exact:
        # The file is Q4_1 (token_embd Q8_0): the blocks hold exactly the fp32 weights, and
        # the kernel multiplies them with the fp32 kernel's own operations.
        assert torch.equal(got, ref)
        return
    assert mean_err > 0  # the quantized path really ran
    assert mean_err < 0.1 * float(ref.std())
    assert agree > 0.9  # near-ties may flip under bf16 activations or Q8_0 re-rounding
    assert abs(ppl / ppl_ref - 1) < 0.05


def test_bf16_model_stays_close_to_fp32(embedded):
    """``--dtype bfloat16`` on the CPU (weights, activations and KV in bf16; oneDNN's matmuls
    and the bf16 paged decode kernel): teacher-forced as one prompt, and as 8 prompt tokens
    then one token a step (every later logit from a decode step)."""
    _, reference, tokenizer = embedded
    ids = tokenizer.encode(HELD_TEXT)
    ref = _teacher_forced(reference, ids)
    _, model, _ = load_model(None, "bfloat16", progress=False)
    stepped = [[Chunk(0, 0, 8)]] + [[Chunk(0, i, i + 1)] for i in range(8, len(ids))]
    ways = {
        "prompt": _teacher_forced(model, ids),
        "decode": torch.cat(run_steps(model, [ids], stepped, block_size=16, max_len=len(ids))),
    }
    for way, got in ways.items():
        _measured_close(f"bf16 model ({way})", got, ref, ids)
