"""Model test fixtures: the transformers reference (our embedded model is in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.embedded import EMBEDDED_FILE_NAME, embedded_model_path


@pytest.fixture(scope="session")
def hf_embedded():
    """transformers' own GGUF loading of the same file: an independent fp32 reference."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        embedded_model_path().parent, gguf_file=EMBEDDED_FILE_NAME, dtype=torch.float32
    )
    return model.eval()
