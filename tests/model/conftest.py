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


@pytest.fixture
def threads():
    """Sets torch's thread count for one test (call it with the count) and restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _isa_params() -> list:
    """Each form of the native microkernel (``native.ISAS``) as a test parameter; the ones
    this machine cannot run are skipped, saying why (an AVX2-only CPU skips avx512)."""
    from pagedkv.model import native

    if native.kernels() is None:
        return [pytest.param("", marks=pytest.mark.skip(reason=native.unavailable_reason()))]
    capable = torch.backends.cpu.get_cpu_capability()
    return [
        name
        if name == "avx2" or capable == "AVX512"
        else pytest.param(name, marks=pytest.mark.skip(reason=f"the CPU is {capable}"))
        for name in native.ISAS
    ]


@pytest.fixture(params=_isa_params())
def isa(request):
    """The test runs with the native projections in this form (``native.set_isa``), and the
    process's own choice is restored after."""
    from pagedkv.model import native

    before = native.isa()
    native.set_isa(request.param)
    yield request.param
    native.set_isa(before)
