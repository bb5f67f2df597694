"""Session fixtures: the embedded model is loaded once (ours and the transformers reference)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model import load_model
from pagedkv.model.embedded import EMBEDDED_FILE_NAME, embedded_model_path


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    """One intra-op thread for these tests: the 2 cores are shared with other jobs, and an
    OpenMP team of 2 that loses a core to them waits at every barrier (measured 6x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def embedded():
    """``(config, model, tokenizer)`` of the embedded SmolLM2, fp32."""
    return load_model(None, progress=False)


@pytest.fixture(scope="session")
def hf_embedded():
    """transformers' own GGUF loading of the same file: an independent fp32 reference."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        embedded_model_path().parent, gguf_file=EMBEDDED_FILE_NAME, dtype=torch.float32
    )
    return model.eval()
