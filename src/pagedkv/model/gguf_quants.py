"""GGUF's Q4_1 and Q8_0 blocks decoded with torch (vectorised over the whole tensor).

The ``gguf`` package decodes every format in numpy, one temporary per step, which took ~8 s for
the embedded model; the two formats that model uses are decoded here in ~0.1 s. Anything else
still goes through ``gguf`` (see ``gguf.py``). ``--weights int4|int8`` re-encodes the decoded
fp32 weights (``native/quant.py``): for these two formats that gives back the file's blocks.

Block layouts (32 weights each, llama.cpp's ``ggml-common.h``):

    Q4_1: f16 d, f16 m, 16 bytes: weight j = d * nibble_j + m; byte i holds nibble i (low 4
          bits) and nibble i + 16 (high 4 bits)                                   20 bytes
    Q8_0: f16 d, 32 x int8 q: weight j = d * q_j                                  34 bytes
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK_WEIGHTS = 32
Q4_1_BLOCK_BYTES = 20
Q8_0_BLOCK_BYTES = 34


def _blocks(raw: np.ndarray, block_bytes: int, rows: int) -> torch.Tensor:
    """uint8 ``[rows, blocks_per_row, block_bytes]`` (a private copy of the mapped file)."""
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1))
    if data.numel() % (rows * block_bytes):
        raise ValueError(f"{data.numel()} bytes do not split into {rows} rows of blocks")
    return data.view(rows, -1, block_bytes)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte ``offset`` of every block, as fp32 ``[rows, blocks, 1]``."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def q4_1_parts(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(nibbles uint8 [rows, cols], d fp32 [rows, groups], m fp32 [rows, groups])`` with
    ``weight = d * nibble + m`` per group of 32 consecutive columns."""
    blocks = _blocks(raw, Q4_1_BLOCK_BYTES, rows)
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    packed = blocks[..., 4:]  # [rows, groups, 16]
    nibbles = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # columns 0..15 then 16..31
    return nibbles.reshape(rows, -1), d.squeeze(-1), m.squeeze(-1)


def dequantize_q4_1(raw: np.ndarray, rows: int) -> torch.Tensor:
    """fp32 ``[rows, cols]`` from Q4_1 blocks."""
    nibbles, d, m = q4_1_parts(raw, rows)
    groups = nibbles.view(rows, -1, BLOCK_WEIGHTS).float()
    return (groups * d[..., None] + m[..., None]).view(rows, -1)


def dequantize_q8_0(raw: np.ndarray, rows: int) -> torch.Tensor:
    """fp32 ``[rows, cols]`` from Q8_0 blocks."""
    blocks = _blocks(raw, Q8_0_BLOCK_BYTES, rows)
    d = _f16(blocks, 0)
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).view(rows, -1)


# GGML type name → torch decoder (rows given; the column count follows from the bytes).
TORCH_DECODERS = {"Q4_1": dequantize_q4_1, "Q8_0": dequantize_q8_0}
