"""Device safety: no tensor that may live on a GPU reaches the host without an explicit copy.

Two checks of the bug class that made ``serve --device cuda`` die at start-up (the model
identity called ``.numpy()`` on a CUDA weight):

* a scan of the torch layers' source: every ``.numpy()``, ``.tolist()`` and ``.item()`` reads a
  tensor copied explicitly (``.cpu()`` or ``.to("cpu")`` in the same expression), or carries a
  ``# host:`` comment on its line saying why its receiver lives on the host (step metadata the
  runner builds there, a numpy array, the CPU-only kernels' tensors);
* the model identity and the KV bytes the store and a P/D pair send, computed from tensors whose
  host reads raise as a GPU tensor's ``.numpy()`` does (``tests/device_fake.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from pagedkv.engine.kv.block_copy import read_blocks, write_blocks
from pagedkv.engine.kv.identity import _digest
from tests.device_fake import DeviceTensor, on_device

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"
# The packages whose tensors may live on a GPU (everything else imports no torch).
TORCH_LAYERS = ("engine", "model", "server", "disagg", "commands", "cli.py")
HOST_READS = {"numpy", "tolist", "item"}
HOST_MARK = "# host:"


def _explicitly_copied(node: ast.expr) -> bool:
    """Whether the receiver chain of a host read holds ``.cpu()`` or ``.to("cpu"...)``."""
    while isinstance(node, ast.Call | ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            args = [*node.args, *(k.value for k in node.keywords)]
            if name == "cpu" or (
                name == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in args)
            ):
                return True
            node = node.func.value
        elif isinstance(node, ast.Call):
            return False
        else:
            node = node.value
    return False


def unmarked_host_reads(source: str, filename: str) -> list[str]:
    """``file:line: .numpy()`` for every host read that is neither copied nor marked."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in HOST_READS or node.args or node.keywords:
            continue
        span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        if _explicitly_copied(node.func.value) or any(HOST_MARK in line for line in span):
            continue
        found.append(f"{filename}:{node.lineno}: .{node.func.attr}()")
    return found


def _torch_layer_files() -> list[Path]:
    files: list[Path] = []
    for layer in TORCH_LAYERS:
        path = SRC / layer
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def test_every_host_read_in_the_torch_layers_is_explicit():
    found = []
    for path in _torch_layer_files():
        found += unmarked_host_reads(path.read_text(), str(path.relative_to(SRC)))
    assert not found, (
        "host reads of tensors that may live on a GPU, without .cpu() first or a "
        f"'{HOST_MARK} why' comment:\n" + "\n".join(found)
    )


def test_the_scan_catches_the_identity_bug_as_it_was():
    # engine/kv/identity.py before the fix (the line that killed `serve --device cuda`).
    before = "h.update(sample.view(torch.uint8).numpy().tobytes())\n"
    assert unmarked_host_reads(before, "identity.py") == ["identity.py:1: .numpy()"]
    after = "h.update(sample.view(torch.uint8).cpu().numpy().tobytes())\n"
    assert unmarked_host_reads(after, "identity.py") == []
    marked = "starts = meta.query_start_loc.tolist()  # host: built by the runner\n"
    assert unmarked_host_reads(marked, "x.py") == []
    assert unmarked_host_reads("n = t.to('cuda').item()\n", "x.py") == ["x.py:1: .item()"]
    assert unmarked_host_reads("n = t.to(device='cpu').item()\n", "x.py") == []


# -- the fake device ------------------------------------------------------------------------------


def test_the_fake_device_refuses_host_reads_like_a_gpu():
    t = on_device(torch.arange(6, dtype=torch.float32))
    view = t[1:].reshape(1, 5)
    assert isinstance(view, DeviceTensor)
    for read in (view.numpy, view.tolist, t[0].item, lambda: float(t[0])):
        with pytest.raises(TypeError, match="device type tensor"):
            read()
    host = view.cpu()
    assert type(host) is torch.Tensor and host.numpy().tolist() == [[1, 2, 3, 4, 5]]
    assert type(t.to("cpu")) is torch.Tensor


def _module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, t in tensors.items():
        module.register_buffer(name, t)
    return module


def test_model_identity_reads_device_weights_through_an_explicit_copy():
    gen = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(64, 8, generator=gen), "b": torch.randn(5000, generator=gen)}
    host = _digest(_module_of(weights))
    device = _digest(_module_of({k: on_device(v) for k, v in weights.items()}))
    assert device == host  # where the weights live is no part of the model's identity
    changed = _digest(_module_of({**weights, "b": weights["b"] + 1}))
    assert changed != host


def _pools(num_blocks: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, 4, 2, 8)  # blocks of 4 tokens, 2 KV heads of 8
    return [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(3)
    ]


def test_store_and_pd_payloads_from_device_pools():
    """The bodies the store writes (and a prefill instance hands its decode peer) are read
    from device pools through one explicit copy, and scattered back into device pools."""
    gen = torch.Generator().manual_seed(1)
    host = _pools(6, gen)
    device = [(on_device(k), on_device(v)) for k, v in host]
    bodies = read_blocks(device, [4, 1])
    assert [bytes(b) for b in bodies] == [bytes(b) for b in read_blocks(host, [4, 1])]
    # Block 4 by hand: layer by layer, K then V, C order (the page layout's body).
    by_hand = b"".join(t[4].numpy().tobytes() for k, v in host for t in (k, v))
    assert bytes(bodies[0]) == by_hand
    target = [(on_device(torch.zeros_like(k)), on_device(torch.zeros_like(v))) for k, v in host]
    write_blocks(target, [0, 5], bodies)
    for (k, v), (tk, tv) in zip(host, target, strict=True):
        assert torch.equal(tk[0].cpu(), k[4]) and torch.equal(tv[5].cpu(), v[1])
        assert not tk[1:5].cpu().any()
