"""benchmarks/gguf_f32.py: the F32 copy llama.cpp is timed on holds the source's model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from pagedkv.model.embedded import embedded_model_path

_SPEC = importlib.util.spec_from_file_location(
    "gguf_f32", Path(__file__).parents[2] / "benchmarks" / "gguf_f32.py"
)
gguf_f32 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gguf_f32)


def test_the_f32_copy_of_the_embedded_model_has_its_metadata_and_dequantized_weights(tmp_path):
    src = embedded_model_path()
    dst = gguf_f32.f32_copy(src, tmp_path / "model.gguf")
    original, copy = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    quantized = {t.tensor_type for t in original.tensors} - {gguf.GGMLQuantizationType.F32}
    assert quantized, "the source should have quantized tensors for this test to mean much"

    file_type = gguf.Keys.General.FILE_TYPE
    assert copy.fields[file_type].contents() == gguf.LlamaFileType.ALL_F32
    names = {n for n in original.fields if not n.startswith("GGUF.")}
    assert names == {n for n in copy.fields if not n.startswith("GGUF.")}
    for name in names - {file_type}:
        assert copy.fields[name].contents() == original.fields[name].contents(), name

    copied = {t.name: t for t in copy.tensors}
    assert copied.keys() == {t.name for t in original.tensors}
    for tensor in original.tensors:
        got = copied[tensor.name]
        assert got.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(got.data, dequantize(tensor.data, tensor.tensor_type))


def test_an_up_to_date_copy_is_reused_and_a_stale_one_rewritten(tmp_path):
    src = tmp_path / "src.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_block_count(1)
    writer.add_tensor("w", gguf.quants.quantize(
        np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), gguf.GGMLQuantizationType.Q8_0
    ), raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dst = gguf_f32.f32_copy(src, tmp_path / "dst.gguf")
    stamp = dst.stat().st_mtime_ns
    assert gguf_f32.f32_copy(src, dst) == dst and dst.stat().st_mtime_ns == stamp  # reused
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))  # the source changed after the copy
    gguf_f32.f32_copy(src, dst)
    assert dst.stat().st_mtime_ns != stamp
    (tensor,) = gguf.GGUFReader(dst).tensors
    np.testing.assert_allclose(tensor.data, np.linspace(-1, 1, 64).reshape(2, 32), atol=1e-2)
