"""An F32 copy of a GGUF, so that llama.cpp can be timed at pagedkv's dtype.

The embedded SmolLM2 ships as Q4_1 (token embedding Q8_0); pagedkv dequantizes it to fp32 at
load. Timing llama.cpp on the Q4_1 file compares a 5-bit engine with an fp32 one; on the F32
copy both read the same ~540 MB per decode step, so the gap is the engines' own.

Every metadata field is copied unchanged except ``general.file_type``; every tensor is
dequantized by gguf's ``dequantize`` (as pagedkv's loader does). The copy is written once next to the user's cache and reused while it is newer than
its source.

    python benchmarks/gguf_f32.py [SRC] [DST]   # default: the embedded model, the cache
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedkv"


def f32_copy(src: Path, dst: Path | None = None) -> Path:
    """Path of an all-F32 copy of ``src``, written (atomically) unless an up-to-date one
    exists at ``dst`` (default: ``cache_dir() / <name>.F32.gguf``)."""
    src = Path(src)
    dst = Path(dst) if dst is not None else cache_dir() / f"{src.stem}.F32.gguf"
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing an F32 copy of {src.name} to {dst} (once; ~4 bytes a weight)", flush=True)
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        # The architecture and the GGUF.* header fields are the writer's own.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_key_value(field.name, int(gguf.LlamaFileType.ALL_F32), kind)
            continue
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


if __name__ == "__main__":
    from pagedkv.model.embedded import embedded_model_path

    args = sys.argv[1:]
    source = Path(args[0]) if args else embedded_model_path()
    print(f32_copy(source, Path(args[1]) if len(args) > 1 else None))
