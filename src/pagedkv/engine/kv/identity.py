"""The model identity: a digest of the loaded weights, computed once at start-up.

Two engines share stored or transferred KV only when they compute the same KV, so the store's
namespace (``kvstore/namespace.py``), a replica's ``/pagedkv/info`` and a P/D pair's handshake
carry this digest; ``startup.build_parts`` computes it once and keeps it in
``EngineParts.model_identity`` for all of them.
"""

from __future__ import annotations

import hashlib

import torch

_SAMPLE_ELEMENTS = 4096  # elements of each weight tensor that go into the model identity


def model_identity(model: torch.nn.Module) -> str:
    """A digest of the model's weights (names, shapes, dtypes and a strided sample of each
    tensor): two engines share stored KV only when they compute the same KV, and two models of
    one shape (or one model quantized two ways) must not. Reads ~4K elements per tensor."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE_ELEMENTS)].contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
