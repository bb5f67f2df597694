"""``--device``, ``--attention-backend`` and ``--cuda-graphs`` on the commands that run the
engine: a machine without a GPU refuses ``--device cuda`` in one line, exit 2, before the load."""

from __future__ import annotations

import pytest
import torch

from pagedkv import cli

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command reaches the slow weight load."""
    import pagedkv.model.loader

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the device was checked")

    monkeypatch.setattr(pagedkv.model.loader, "load_model", load)
    monkeypatch.setattr("pagedkv.model.load_model", load, raising=False)


COMMANDS = {
    "generate": ["generate", "hi"],
    "demo": ["demo"],
    "profile": ["profile", "--quick"],
    "serve": ["serve", "--port", "0"],
}


def _one_error_line(capsys, command: str, words: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv {command}: error: ") and words in err, err
    assert err.count("\n") == 1, err  # one line, no traceback


@no_gpu
@pytest.mark.parametrize("command", COMMANDS)
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(no_model_load, capsys, command):
    assert cli.main([*COMMANDS[command], "--device", "cuda"]) == 2
    _one_error_line(capsys, command, "no CUDA device is visible")


@pytest.mark.parametrize("command", ["generate", "profile"])
def test_an_unknown_device_is_refused(no_model_load, capsys, command):
    assert cli.main([*COMMANDS[command], "--device", "tpu"]) == 2
    _one_error_line(capsys, command, "device must be auto, cpu, cuda or cuda:N, got 'tpu'")


def test_cuda_graphs_need_a_gpu_and_the_triton_backend(no_model_load, capsys):
    assert cli.main(["generate", "hi", "--device", "cpu", "--cuda-graphs"]) == 2
    _one_error_line(capsys, "generate", "--cuda-graphs needs --device cuda")


def test_a_quantized_model_on_a_gpu_is_refused():
    from pagedkv.errors import UsageError
    from pagedkv.model.loader import load_model

    with pytest.raises(UsageError, match="runs on the CPU only"):
        load_model(None, "float32", weights="int4", device="cuda")
