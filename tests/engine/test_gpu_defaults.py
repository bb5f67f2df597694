"""GPU defaults decided at start-up, checked here with the placement a GPU would resolve to:
CUDA graphs on where they can run, the reserved policy on the GPU's own kernels, the
busy-machine warning only where the model runs on CPU threads."""

from __future__ import annotations

import pytest
import torch

import pagedkv.engine.pool_plan as pool_plan
from pagedkv.commands import busy_machine
from pagedkv.engine import EngineConfig
from pagedkv.errors import UsageError
from pagedkv.model.device import Placement
from pagedkv.pages.backends import resolve_backend

GPU = Placement(torch.device("cuda", 0), "bfloat16", resolve_backend("triton", "cuda")[0])


@pytest.fixture
def on_a_gpu(monkeypatch):
    """``resolve_placement`` answers as on a machine with a GPU (the backend given, or
    triton)."""

    def resolve(device, dtype, backend):
        rule, note = resolve_backend(backend, "cuda")
        return Placement(GPU.device, dtype or "bfloat16", rule, note)

    monkeypatch.setattr(pool_plan, "resolve_placement", resolve)


def test_cuda_graphs_default_on_a_gpu_with_triton_only(on_a_gpu):
    placement = pool_plan.engine_placement(EngineConfig(device="cuda"))
    assert placement == GPU
    assert pool_plan.graphs_wanted(EngineConfig(device="cuda"), placement)
    assert not pool_plan.graphs_wanted(EngineConfig(device="cuda", cuda_graphs=False), placement)
    torch_sdpa = pool_plan.engine_placement(EngineConfig(attention_backend="torch-sdpa"))
    assert not pool_plan.graphs_wanted(EngineConfig(), torch_sdpa)
    with pytest.raises(UsageError, match="--cuda-graphs needs --device cuda and the triton"):
        pool_plan.engine_placement(EngineConfig(attention_backend="torch-sdpa", cuda_graphs=True))
    # The old name of an earlier vocabulary still works, and says what it became.
    old = pool_plan.engine_placement(EngineConfig(attention_backend="torch"))
    assert old.attention_backend == "torch-sdpa" and "now called torch-sdpa" in old.backend_note


def test_cuda_graphs_stay_off_on_the_cpu():
    placement = pool_plan.engine_placement(EngineConfig(device="cpu"))
    assert not pool_plan.graphs_wanted(EngineConfig(device="cpu"), placement)


def test_reserved_runs_on_the_triton_kernels_on_a_gpu(on_a_gpu):
    """A max_model_len region is one block, and the kernels' tiles gather through the table:
    the reserved baseline runs where the paged policies run, with CUDA graphs."""
    placement = pool_plan.engine_placement(EngineConfig(policy="reserved"))
    assert placement.attention_backend == "triton" and placement.device == GPU.device
    assert pool_plan.graphs_wanted(EngineConfig(policy="reserved"), placement)


def test_the_busy_warning_is_for_cpu_threads_only(monkeypatch, capsys):
    monkeypatch.delenv(busy_machine.QUIET_ENV, raising=False)
    monkeypatch.setattr(busy_machine.os, "getloadavg", lambda: (50.0, 50.0, 50.0))
    assert busy_machine.warn_if_busy("serve", threads=2, device="cpu") is not None
    assert "this machine is busy" in capsys.readouterr().err
    monkeypatch.setattr("pagedkv.model.device.resolve_device", lambda name: GPU.device)
    assert busy_machine.warn_if_busy("serve", threads=2, device="cuda") is None
    assert capsys.readouterr().err == ""
