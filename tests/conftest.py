"""Fixtures shared by every torch test package (model, engine, server)."""

from __future__ import annotations

import os

# Triton's kernels run in its interpreter on this suite's CPU tensors. triton fixes the mode
# when it is first imported (transformers imports it too, before any kernel), so it is set
# here, before anything; setdefault: a GPU run may export TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedkv.model import load_model  # noqa: E402

# The start-up warning about a busy machine (commands/busy_machine.py) would be a second stderr
# line in every test that checks a one-line error whenever the suite itself keeps the cores
# busy; the tests of the warning clear this variable. Subprocesses inherit it.
os.environ["PAGEDKV_NO_BUSY_WARNING"] = "1"


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread for the whole suite: the 2 cores may be shared with other jobs, and
    an OpenMP team of 2 that loses a core stalls at every barrier (measured 6x slower). Speed is
    measured in benchmarks/, never here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def embedded():
    """``(config, model, tokenizer)`` of the embedded SmolLM2-135M, fp32, loaded once."""
    return load_model(None, progress=False)
