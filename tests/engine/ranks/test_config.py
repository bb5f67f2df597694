"""``--tensor-parallel-size`` at the edge: bad values and combinations are one line each, before
any process starts or any weight loads."""

from __future__ import annotations

import pytest

from pagedkv.engine import EngineConfig
from pagedkv.engine.startup import build_parts
from pagedkv.errors import UsageError
from tests.model.tiny import make_tiny_model


@pytest.mark.parametrize("size", [0, -1, True, 1.5])
def test_a_size_is_a_whole_number_of_one_or_more(size):
    with pytest.raises(UsageError, match="--tensor-parallel-size must be a whole number") as err:
        EngineConfig(tensor_parallel_size=size)
    assert err.value.param == "tensor_parallel_size"


def test_cuda_graphs_are_refused_with_ranks():
    with pytest.raises(UsageError, match="--cuda-graphs with --tensor-parallel-size > 1"):
        EngineConfig(tensor_parallel_size=2, cuda_graphs=True)


def test_a_loaded_model_is_one_ranks(tiny_llama):
    config = EngineConfig(tensor_parallel_size=2, log_startup=False, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(UsageError, match="a model loaded already is one rank's"):
        build_parts(config, tiny_llama)


def test_quantized_blocks_a_split_would_cut_are_refused_before_the_load(tmp_path, capsys):
    from pagedkv.cli import main

    make_tiny_model("llama", tmp_path)  # MLP rows 96: 48 a rank, not whole blocks of 32
    argv = [
        "generate",
        "--model",
        str(tmp_path),
        "--tensor-parallel-size",
        "2",
        "--weights",
        "int8",
        "hi",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "cut the quantized blocks of 32 in two" in err
    assert "loading" not in err
