"""One attention-backend interface (in the spirit of mini-sglang's ``BaseAttnBackend``):
``plan`` a step once, ``attend`` one layer (the new K/V written first), ``copy_blocks`` for
copy-on-write and partial prefix hits, and a ``rule`` declaring the block sizes it accepts and why (torch-free:
``pages/attention_rules.py``, which the planner's ``--backend`` reads too). Three backends
implement it:

=============  ============================================  ===================================
``native``     pagedkv's C kernels (``model/native/``)       the CPU's default (fp32, bf16)
``torch-sdpa`` torch ops, K/V gathered by slot, then SDPA    any device: the reference path
``triton``     pagedkv's Triton kernels (``model/triton/``)  the GPU's default
=============  ============================================  ===================================

The model knows nothing of which one runs: ``DecoderLayer`` asks the step's plan to run the
whole layer in the backend's own fused form (``run_layer``; only the native backend has one:
a decode step in one C call, RoPE and the K/V store in another), else computes Q, K, V and
calls ``attend``. Built by ``make_backend`` once per engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.kv_pool import KVCache
from pagedkv.pages.attention_rules import RULES, BackendRule

if TYPE_CHECKING:  # the layer imports this module
    from pagedkv.model.decoder_layer import DecoderLayer


class StepAttention(Protocol):
    """One step's attention on one backend: planned once from the step's metadata, then used
    by every layer in turn. Holds device tensors the layers read; valid for that step only."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, scale: float
    ) -> torch.Tensor:
        """One layer: ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (RoPE applied) ->
        ``[T, Hq * D]``. Writes the new K/V into ``kv_cache`` first (a prefill reads itself);
        mutates nothing else."""
        ...

    def run_layer(
        self,
        layer: DecoderLayer,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
    ) -> torch.Tensor | None:
        """The whole layer in the backend's own fused form (its output, K/V written), or None:
        the layer then runs its ops and calls ``attend``."""
        ...


class AttentionBackend(Protocol):
    """An attention backend of one engine (one device, one set of kernels)."""

    @property
    def rule(self) -> BackendRule:
        """The block sizes and head dims it accepts, and why (the planner reads the same)."""
        ...

    def plan(
        self, meta: AttentionMetadata, kv_caches: list[KVCache], block_size: int
    ) -> StepAttention:
        """The step's attention from its metadata (host tensors, as the runner makes them)."""
        ...

    def graph_plan(
        self, meta: AttentionMetadata, block_size: int, max_context_len: int
    ) -> StepAttention | None:
        """A decode plan over ``meta``'s static device buffers that a CUDA graph can record and
        replay (no host value read), for contexts up to ``max_context_len``; None: this
        backend's steps cannot be captured."""
        ...

    def copy_blocks(
        self,
        pool: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        num_tokens: torch.Tensor | None = None,
    ) -> None:
        """``pool[dst[i]] = pool[src[i]]`` for one K or V pool (copy-on-write); ``src``/``dst``
        int64 on the pool's device. ``num_tokens`` (int64, same device): copy only slots
        ``[0, num_tokens[i])`` of each block, keeping the rest of ``dst[i]`` (the matched
        tokens of a partial prefix hit, ``kvcache/partial.py``)."""
        ...


def backend_rule(attention_backend: str, device: torch.device) -> BackendRule:
    """The rule of the backend a placement runs (``--attention-backend triton|torch``), known
    before the weights load: ``torch`` is the native C kernels on the CPU where they build,
    torch SDPA elsewhere."""
    from pagedkv.model import native

    if attention_backend == "triton":
        return RULES["triton"]
    native_cpu = device.type == "cpu" and native.kernels() is not None
    return RULES["native" if native_cpu else "torch-sdpa"]


def make_backend(name: str, model, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (a ``BackendRule`` name) for ``model`` (a ``CausalLM``:
    its dtype, heads and kernels) on ``device``; ``native`` where the model's load found no C
    kernels (an fp16 model, say) is torch SDPA."""
    if name == "triton":
        from pagedkv.model.triton.backend import TritonBackend
        from pagedkv.model.triton.kernels import load_kernels

        return TritonBackend(load_kernels(device), device, model.config.num_kv_heads)
    from pagedkv.model.torch_backend import NativeBackend, TorchBackend

    if name == "native" and model.attention_kernels is not None:
        return NativeBackend(model)
    return TorchBackend(device, model.dtype)
