"""The GGUF ``deepseek2`` tensors whose layout is not one canonical tensor each, as llama.cpp's
converter writes them: the routed experts stacked (``ffn_{gate,up,down}_exps``, ``[E, I, H]`` /
``[E, H, I]`` in torch order), and, from converters that prepare MLA absorption, ``kv_b_proj``
split per head into ``attn_k_b`` (``[H, R, Dn]``: the key rows, transposed) and ``attn_v_b``
(``[H, Dv, R]``). Older converters wrote ``attn_kv_b`` whole (``gguf.py``'s table)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_STACKED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_SPLIT_KV_B = re.compile(r"^blk\.(\d+)\.attn_([kv])_b\.weight$")


class DeepseekPieces:
    """Turns those tensors into canonical ones; holds a layer's ``attn_k_b`` until its
    ``attn_v_b`` arrives (either order)."""

    def __init__(self) -> None:
        self._halves: dict[tuple[str, str], torch.Tensor] = {}

    @staticmethod
    def handles(gguf_name: str) -> bool:
        return bool(_STACKED.match(gguf_name) or _SPLIT_KV_B.match(gguf_name))

    def canonical(self, gguf_name: str, data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(canonical name, tensor)`` of one such tensor (none while a half waits)."""
        if match := _STACKED.match(gguf_name):
            layer, part = match.groups()
            for expert, weight in enumerate(data):
                yield f"layers.{layer}.experts.{expert}.{part}_proj.weight", weight
            return
        match = _SPLIT_KV_B.match(gguf_name)
        assert match is not None  # ``handles`` said so
        layer, half = match.groups()
        self._halves[(layer, half)] = data
        if (layer, "k") in self._halves and (layer, "v") in self._halves:
            k_b, v_b = self._halves.pop((layer, "k")), self._halves.pop((layer, "v"))
            per_head = torch.cat((k_b.transpose(1, 2), v_b), dim=1)  # [H, Dn + Dv, R]
            yield f"layers.{layer}.kv_b_proj.weight", per_head.reshape(-1, per_head.shape[2])

    def unpaired(self) -> list[str]:
        """GGUF names of halves whose other half never came (a truncated conversion)."""
        return [f"blk.{layer}.attn_{half}_b.weight" for layer, half in self._halves]
