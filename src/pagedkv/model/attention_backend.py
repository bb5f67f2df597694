"""One attention-backend interface (in the spirit of mini-sglang's ``BaseAttnBackend``): a
backend ``plan``s a step once, and the step's plan supplies the *ops* the one decoder layer
(``decoder_layer.py``) calls in its one order. A backend never runs a layer of its own.

The ops a step supplies (``StepOps``; ``LayerOps`` is the plain torch form of each, which a
backend overrides where it has a fused kernel):

- ``norm``: an RMSNorm (a Triton launch in bf16);
- ``rope_attend``: RoPE on Q and K, this step's K/V written to their slots, attention over the
  paged pool (RoPE + the store in one C call or one Triton launch where the backend has it);
- ``mla_attend``: an MLA layer's attention (``mla/``): this step's latent records written to
  their slots, attention over the paged latents (absorbed for decode rows: Triton's kernel on
  the GPU, torch ops elsewhere);
- ``add_norm``: a projection added to the residual stream, then the next RMSNorm (one Triton
  launch for the add and the norm in bf16);
- ``silu_mul``: SwiGLU's ``silu(gate(x)) * up(x)`` from the gate/up product of ``x`` (one C
  call, or one Triton launch);
- ``layer_chain``: the whole layer at once where a backend compiled the same order into one
  call (the native C decode chain), else None.

Which backends exist, where they run and what block sizes they accept is one torch-free table,
``pages/backends.py``; ``make_backend`` builds the entry's factory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.kv_pool import KVCache
from pagedkv.pages.backends import BackendRule

if TYPE_CHECKING:  # only types: the layers import this module, never the reverse
    from pagedkv.model.layers import RMSNorm, SwiGLU
    from pagedkv.model.mla.latent import LatentWeights
    from pagedkv.model.projection import ProjectionBase


class HeadShape(NamedTuple):
    """A layer's attention heads: query heads, KV heads, and the width of one."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


class StepOps(Protocol):
    """One step's ops on one backend: planned once from the step's metadata, then used by every
    layer in turn. Holds device tensors the layers read; valid for that step only."""

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)``, a new tensor."""
        ...

    def rope_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        heads: HeadShape,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one layer from its fused QKV product ``[T, (Hq + 2 Hkv) * D]``: RoPE on
        Q and K, the new K/V written into ``kv_cache`` first (a prefill reads itself), then
        ``[T, Hq * D]``. May overwrite ``qkv``; mutates nothing else."""
        ...

    def mla_attend(
        self,
        q: torch.Tensor,
        records: torch.Tensor,
        kv_cache: KVCache,
        latent: LatentWeights,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one MLA layer: ``q`` ``[T, H, Dn + Dr]`` (rope part rotated),
        ``records`` ``[T, R + Dr]`` the step's latent records, written into ``kv_cache``
        (``(latents,)``) first; returns ``[T, H * Dv]``. Mutates nothing else."""
        ...

    def add_norm(
        self, norm: RMSNorm, residual: torch.Tensor, proj: ProjectionBase, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(r), r)`` with ``r = residual + proj(x)``, new tensors."""
        ...

    def silu_mul(self, mlp: SwiGLU, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate(x)) * up(x)`` ``[T, I]`` of ``mlp``'s gate/up product, a new tensor."""
        ...

    def layer_chain(
        self,
        index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
    ) -> torch.Tensor | None:
        """Layer ``index`` in one call where the backend compiled its order (its output, K/V
        written), or None: the layer runs its ops."""
        ...


class LayerOps:
    """Every op in plain torch (the modules' own forms), but attention, which each backend
    supplies: the base a step's ops override where their backend fuses."""

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def add_norm(
        self, norm: RMSNorm, residual: torch.Tensor, proj: ProjectionBase, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = proj.added_to(residual, x)
        return norm(residual), residual

    def silu_mul(self, mlp: SwiGLU, x: torch.Tensor) -> torch.Tensor:
        return mlp.gated(x)

    def layer_chain(
        self,
        index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
    ) -> torch.Tensor | None:
        return None


class AttentionBackend(Protocol):
    """An attention backend of one engine (one device, one set of kernels)."""

    @property
    def rule(self) -> BackendRule:
        """Its entry of ``pages/backends.py``: block sizes, head dims, devices, graphs."""
        ...

    def plan(self, meta: AttentionMetadata, kv_caches: list[KVCache], block_size: int) -> StepOps:
        """The step's ops from its metadata (host tensors, as the runner makes them)."""
        ...

    def graph_plan(
        self, meta: AttentionMetadata, block_size: int, max_context_len: int
    ) -> StepOps | None:
        """A decode plan over ``meta``'s static device buffers that a CUDA graph can record and
        replay (no host value read), for contexts up to ``max_context_len``; None: this
        backend's steps cannot be captured (``rule.cuda_graphs`` False)."""
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


def make_backend(rule: BackendRule, model, device: torch.device) -> AttentionBackend:
    """The backend of ``rule`` (its table entry's factory) for ``model`` (a ``CausalLM``: its
    dtype, heads and layers) on ``device``."""
    module, _, name = rule.factory.partition(":")
    return getattr(importlib.import_module(module), name)(model, device)
