"""No hidden host syncs in the step loop (issue 46: the host off the critical path).

On a GPU, ``torch.tensor(values, device=cuda)`` is a blocking copy from pageable memory (the
host waits for everything queued on the stream: with scheduling one step ahead, the next
step's whole forward pass), and ops whose output size depends on the data (``unique``,
``nonzero``, ``masked_select``; ``bincount`` reads its max) read the device back. A review
found both in the sampler, the logits processing and the grammar masks, and a ``.cpu()`` of
the drawn ids queued behind the next forward; none of it can show on a CPU. So:

* a scan of the step loop's modules for those calls (``# sync: why`` marks a documented one);
* ``to_host`` reads only the copy ``draw`` queued right behind the draws (``HostCopy``), never
  the device tensors themselves;
* ``draw`` with every per-row feature on logits that refuse host reads as a GPU's do
  (``tests/device_fake.py``) gives the host draw's tokens.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from pagedkv.engine.device_copies import HostCopy
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.step.logits_processing import RowTokens
from pagedkv.engine.step.sampler import DeviceDraws, draw, to_host
from tests.device_fake import on_device

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"
# What runs every step between a forward pass being queued and the next one.
STEP_LOOP = (
    "engine/step/loop.py", "engine/step/record.py", "engine/structured/grammar.py", "engine/step/logits_processing.py", "engine/runner.py",
    "engine/step/draws.py", "engine/step/sampler.py", "model/triton",
)  # fmt: skip
SIZED_BY_DATA = {"unique", "unique_consecutive", "nonzero", "masked_select", "bincount"}
SYNC_MARK = "# sync:"


def syncing_calls(source: str, filename: str) -> list[str]:
    """``file:line: what`` for each call in ``source`` that makes the host wait for a GPU's
    stream, unless its line carries ``# sync:``."""
    lines, found = source.splitlines(), []  # (line, what), in the walk's order
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        pageable = name in ("tensor", "as_tensor") and any(k.arg == "device" for k in node.keywords)
        if not (pageable or name in SIZED_BY_DATA):
            continue
        span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        if not any(SYNC_MARK in line for line in span):
            found.append((node.lineno, f"{name}({'device=' if pageable else ''})"))
    return [f"{filename}:{line}: {what}" for line, what in sorted(found, key=lambda f: f[0])]


def test_the_step_loop_makes_no_hidden_host_syncs():
    found = []
    for part in STEP_LOOP:
        path = SRC / part
        for f in [path] if path.is_file() else sorted(path.rglob("*.py")):
            found += syncing_calls(f.read_text(), str(f.relative_to(SRC)))
    assert not found, (
        "calls that wait for the GPU in the step loop (use engine/device_copies.py, or count on "
        f"the host; '{SYNC_MARK} why' if it must):\n" + "\n".join(found)
    )


def test_the_scan_catches_the_syncs_as_they_were():
    # sampler.py, logits_processing.py and grammar.py before the fix
    before = (
        "index = torch.tensor(rows, device=logits.device)\n"
        "seen = torch.tensor(ids, device=dev).unique()\n"
        "counts = torch.bincount(t, minlength=vocab)\n"
    )
    assert syncing_calls(before, "x.py") == [
        "x.py:1: tensor(device=)", "x.py:2: unique()", "x.py:2: tensor(device=)",
        "x.py:3: bincount()",
    ]  # fmt: skip
    after = "index = to_device(rows, torch.int64, logits.device)\nt = torch.tensor(rows)\n"
    assert syncing_calls(after, "x.py") == []
    assert syncing_calls("i = m.nonzero()  # sync: made on the host\n", "x.py") == []


class _Untouchable:
    """Stands for a device tensor that ``to_host`` must not read (a ``.cpu()`` of it would
    wait for everything queued after the draws)."""

    def __getattr__(self, name):
        raise AssertionError(f"to_host touched the device tensor (.{name})")


class _Event:
    synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True


def test_to_host_waits_for_the_queued_copy_only():
    event = _Event()
    ids, chosen = torch.tensor([5, 7]), torch.tensor([-0.5])
    values, top = torch.tensor([[-0.5, -1.25]]), torch.tensor([[7, 3]])
    d = DeviceDraws(_Untouchable(), [1], [2], HostCopy((ids, chosen, values, top), event),  # type: ignore[arg-type]
                    _Untouchable(), _Untouchable(), _Untouchable())  # type: ignore[arg-type]  # fmt: skip
    result = to_host(d)
    assert event.synchronized
    assert result.token_ids == [5, 7]
    assert result.logprobs == [None, -0.5] and result.top_logprobs == [
        None,
        [(7, -0.5), (3, -1.25)],
    ]


def test_draw_on_a_device_reads_nothing_back_and_draws_the_hosts_tokens():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen)
    rows = [RowTokens([1, 2, 3], [4, 4, 9], {0}), None, RowTokens([5], [], {0}), None]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.25, logit_bias={7: 3.0}, logprobs=2),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, min_tokens=2, logprobs=0),
        SamplingParams(temperature=0, top_k=5),
    ]  # fmt: skip
    host = to_host(draw(logits, params, [None] * 4, rows))
    device = to_host(draw(on_device(logits), params, [None] * 4, rows))
    assert device == host
    assert host.token_ids[1] == int(logits[1].argmax())  # no processing: the plain argmax
