"""GGUF files: tensors dequantized once → canonical-named weights (the header's shape facts are
read by ``pages/sources.py``; the tokenizer reads the metadata from ``gguf_metadata``).

The ``gguf`` package reads the file (memory-mapped) and dequantizes every quantization it
knows (Q4_0/1, Q5_x, Q8_0, K-quants, F16, BF16, F32); Q4_1 and Q8_0, the embedded model's, are
decoded by ``gguf_quants.py`` in torch (~30x faster). Each tensor becomes fp32 (or the requested
dtype) at load, and the mapped file is released afterwards; ``quant.py`` may re-pack them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from pagedkv.errors import UsageError
from pagedkv.model.config import ARCHITECTURES, ModelConfig
from pagedkv.model.gguf_deepseek import DeepseekPieces
from pagedkv.model.gguf_file import GGUFFile, open_gguf
from pagedkv.model.gguf_quants import TORCH_DECODERS

# GGUF tensor name → canonical name (see llama.py). Per-layer names follow "blk.{i}.".
GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}
GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "q_proj.weight",
    "attn_k.weight": "k_proj.weight",
    "attn_v.weight": "v_proj.weight",
    "attn_q.bias": "q_proj.bias",
    "attn_k.bias": "k_proj.bias",
    "attn_v.bias": "v_proj.bias",
    "attn_output.weight": "o_proj.weight",
    "attn_q_norm.weight": "q_norm.weight",  # qwen3
    "attn_k_norm.weight": "k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "gate_proj.weight",
    "ffn_up.weight": "up_proj.weight",
    "ffn_down.weight": "down_proj.weight",
    # deepseek2: the latent attention and the experts (stacked ones: ``gguf_deepseek.py``)
    "attn_q_a.weight": "q_a_proj.weight",
    "attn_q_a_norm.weight": "q_a_norm.weight",
    "attn_q_b.weight": "q_b_proj.weight",
    "attn_kv_a_mqa.weight": "kv_a_proj.weight",
    "attn_kv_a_norm.weight": "kv_a_norm.weight",
    "attn_kv_b.weight": "kv_b_proj.weight",
    "ffn_gate_inp.weight": "router.weight",
    "exp_probs_b.bias": "router.bias",
    "ffn_gate_shexp.weight": "shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "shared_experts.down_proj.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")

ProgressCallback = Callable[[int, int], None]  # (tensors done, tensors total)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file; ``FileNotFoundError``/``UsageError`` with the path when it cannot be read."""
    return open_gguf(path)


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """All key/value fields as Python values (strings, numbers, lists)."""
    return dict(reader.metadata)


def unpermute_qk_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order so the half-split RoPE applies.

    Within each head, llama.cpp stores rows as interleaved pairs (r0, r_{d/2}, r1, r_{d/2+1}, ...)
    for its adjacent-pair rotation; Hugging Face order is the two halves one after the other.
    Works for weights ``[rows, in]`` and biases ``[rows]``.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
        .contiguous()
    )


def canonical_name(gguf_name: str) -> str:
    """Our canonical name of a GGUF tensor; ``ValueError`` for a tensor we do not understand."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in GGUF_LAYER_NAMES:
        return f"layers.{match.group(1)}.{GGUF_LAYER_NAMES[match.group(2)]}"
    raise UsageError(f"unexpected GGUF tensor {gguf_name!r}")


def iter_gguf_weights(
    reader: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    progress: ProgressCallback | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical name, tensor)`` per GGUF tensor, dequantized and in HF row order.

    Each yielded tensor is freshly allocated and owned by the caller.
    """
    import gguf

    permuted = ARCHITECTURES[config.architecture].gguf_qk_permuted
    pieces = DeepseekPieces()
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors, start=1):
        name = tensor.name if pieces.handles(tensor.name) else canonical_name(tensor.name)
        # GGUF lists dims fastest-first; we want torch order (rows, cols).
        shape = tuple(int(d) for d in reversed(tensor.shape))
        decoder = TORCH_DECODERS.get(tensor.tensor_type.name)
        if decoder is not None and len(shape) == 2:
            data = decoder(tensor.data, shape[0])
        else:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            # F32 tensors come back as read-only views of the memory map: copy those only.
            array = np.require(array, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])
            data = torch.from_numpy(array.reshape(shape))
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_qk_rows(data, config.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_qk_rows(data, config.num_kv_heads)
        if pieces.handles(name):
            yield from ((n, t.to(dtype)) for n, t in pieces.canonical(name, data))
        else:
            yield name, data.to(dtype)
        if progress is not None:
            progress(done, total)
    if pieces.unpaired():
        raise UsageError(f"GGUF lacks the other half of {', '.join(pieces.unpaired())}")
