"""The model identity: a digest of the loaded weights, computed once at start-up.

Two engines share stored or transferred KV only when they compute the same KV, so the store's
namespace (``kvstore/namespace.py``), a replica's ``/pagedkv/info`` and a P/D pair's handshake
carry this digest. It is computed once per loaded model (remembered by a weak reference to
the model, so a model that is dropped takes its entry with it); ``EngineParts.model_identity``
is how the engine's parts ask.
"""

from __future__ import annotations

import hashlib
import weakref

import torch

from pagedkv.model.llama import CausalLM

_SAMPLE_ELEMENTS = 4096  # elements of each weight tensor that go into the model identity
_IDENTITIES: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def model_identity(model: torch.nn.Module) -> str:
    """The digest the loader took of the weights as it read them (``model/shards.py``'s
    ``WeightsDigest``: the same for every tensor-parallel split of one model), else
    ``_digest(model)``, computed on the first call for this model object only."""
    if isinstance(model, CausalLM) and model.weights_digest is not None:
        return model.weights_digest
    identity = _IDENTITIES.get(model)
    if identity is None:
        identity = _IDENTITIES[model] = _digest(model)
    return identity


def _digest(model: torch.nn.Module) -> str:
    """A digest of the model's weights (names, shapes, dtypes and a strided sample of each
    tensor): two engines share stored KV only when they compute the same KV, and two models of
    one shape (or one model quantized two ways) must not. Reads ~4K elements per tensor,
    copied to the host explicitly (the weights may live on a GPU)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE_ELEMENTS)].contiguous()
        h.update(sample.view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()
