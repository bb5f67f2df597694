"""What of each canonical weight one tensor-parallel rank loads, and the digest of the weights
that names the model whatever the split.

Rank ``r`` of ``tp_size`` (``pages/head_split.py`` says which heads are whose) keeps, of the
canonical tensors (``weights.py``'s names):

- the rows of its query heads of ``q_proj``, of its KV heads of ``k_proj`` and ``v_proj`` (biases
  alike), and its ``r``-th run of the MLP's rows of ``gate_proj`` and ``up_proj``: the
  column-parallel products, whose outputs stay on the rank;
- the matching *columns* of ``o_proj`` and ``down_proj``: the row-parallel products, whose
  partial sums one all-reduce joins (``parallel.py``);
- its ``r``-th run of vocabulary rows of ``embed_tokens`` and ``lm_head``, padded with zero rows
  to ``ceil(vocab / tp_size)``: the vocab-parallel ends;
- every norm (and ``rope_freqs``) whole.

So a rank's model is an ordinary ``CausalLM`` of a smaller shape (``local_config``), loaded by
the same code on the same kernels, quantized ones included (``--weights int4|int8`` quantizes
each rank's slices: blocks of 32 inputs, so a row-parallel slice must start on one).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch

from pagedkv.errors import UsageError
from pagedkv.model.config import ModelConfig
from pagedkv.pages.head_split import PARAM, HeadSplit

# A canonical weight's name ending -> (the dimension a rank slices, which run it takes).
SLICES: dict[str, tuple[int, str]] = {
    "q_proj.weight": (0, "heads"),
    "q_proj.bias": (0, "heads"),
    "k_proj.weight": (0, "kv_heads"),
    "k_proj.bias": (0, "kv_heads"),
    "v_proj.weight": (0, "kv_heads"),
    "v_proj.bias": (0, "kv_heads"),
    "o_proj.weight": (1, "heads"),
    "gate_proj.weight": (0, "mlp"),
    "up_proj.weight": (0, "mlp"),
    "down_proj.weight": (1, "mlp"),
    "embed_tokens.weight": (0, "vocab"),
    "lm_head.weight": (0, "vocab"),
}
# Quantized weights come in blocks of this many inputs (``quant.GROUP``, GGUF's Q4_1 and Q8_0).
QUANT_BLOCK = 32


@dataclass(frozen=True)
class RankShard:
    """Rank ``rank``'s part of a model of ``config``'s shape split by ``split``."""

    config: ModelConfig
    split: HeadSplit
    rank: int

    @classmethod
    def of(cls, config: ModelConfig, tp_size: int, rank: int, weights: str = "float") -> RankShard:
        """``UsageError`` (one line, naming ``--tensor-parallel-size``) where the model does not
        split: an MLA model (its latent projections and experts have no rank shares yet), heads
        (``HeadSplit``), the MLP's rows, or quantized blocks cut in two."""
        if tp_size > 1 and config.mla is not None:
            raise UsageError(
                f"--tensor-parallel-size {tp_size}: {config.architecture} (MLA attention, "
                "experts) runs on one rank only; give --tensor-parallel-size 1",
                PARAM,
            )
        split = HeadSplit(tp_size, config.num_heads, config.num_kv_heads)
        inter = config.intermediate_size
        if inter % tp_size:
            raise UsageError(
                f"--tensor-parallel-size {tp_size} does not divide the model's intermediate size "
                f"{inter}",
                PARAM,
            )
        if weights != "float":
            for what, inputs in (
                ("the MLP's", inter),
                ("the attention's", config.num_heads * config.head_dim),
            ):
                if inputs % QUANT_BLOCK == 0 and (inputs // tp_size) % QUANT_BLOCK:
                    raise UsageError(
                        f"--weights {weights} at --tensor-parallel-size {tp_size}: a rank's "
                        f"{inputs // tp_size} of {what} {inputs} inputs would cut the quantized "
                        f"blocks of {QUANT_BLOCK} in two (use --weights float or another size)",
                        PARAM,
                    )
        return cls(config, split, rank)

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows of each rank (the last rank's padded with zero rows)."""
        return -(-self.config.vocab_size // self.split.tp_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def run(self, kind: str) -> tuple[int, int]:
        """``(start, stop)`` of this rank's run of ``kind`` rows (``SLICES``' second field)."""
        c, split = self.config, self.split
        if kind == "heads":
            heads = split.heads(self.rank)
            return heads.start * c.head_dim, heads.stop * c.head_dim
        if kind == "kv_heads":
            heads = split.kv_heads(self.rank)
            return heads.start * c.head_dim, heads.stop * c.head_dim
        if kind == "mlp":
            width = c.intermediate_size // split.tp_size
            return self.rank * width, (self.rank + 1) * width
        return self.vocab_start, self.vocab_start + self.vocab_rows

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the canonical tensor ``name`` (a new tensor: the whole one may
        be freed); norms and other unsplit tensors are returned as they are."""
        rule = next((r for end, r in SLICES.items() if name.endswith(end)), None)
        if rule is None:
            return tensor
        dim, kind = rule
        start, stop = self.run(kind)
        start = min(start, tensor.shape[dim])
        part = tensor.narrow(dim, start, min(stop, tensor.shape[dim]) - start)
        if kind == "vocab" and part.shape[0] < stop - start:  # the last rank's padding
            pad = torch.zeros(stop - start - part.shape[0], *part.shape[1:], dtype=part.dtype)
            return torch.cat((part, pad))
        return part.clone()

    def local_config(self) -> ModelConfig:
        """The shape of this rank's model: its heads, MLP rows and vocabulary rows."""
        c, split = self.config, self.split
        return replace(
            c,
            num_heads=split.rank_heads,
            num_kv_heads=split.rank_kv_heads,
            intermediate_size=c.intermediate_size // split.tp_size,
            vocab_size=self.vocab_rows,
            shape=None,
        )


class WeightsDigest:
    """A digest of the canonical weights as they are read (names, shapes, dtypes and a strided
    sample of each), before any rank slices them, with the dtype and weight format: the model
    identity (``engine/kv/identity.py``) of every split of one model, so a P/D pair at
    different tensor-parallel sizes shares its store namespace. Reads ~4K elements a tensor."""

    SAMPLE_ELEMENTS = 4096

    def __init__(self, dtype: torch.dtype, weights: str) -> None:
        self._head = f"canonical;{dtype};{weights};".encode()
        self._parts: dict[str, bytes] = {}  # name -> its part's digest (any read order)

    def update(self, name: str, tensor: torch.Tensor) -> None:
        h = hashlib.blake2b(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel():
            sample = flat[:: max(1, flat.numel() // self.SAMPLE_ELEMENTS)].contiguous()
            h.update(sample.view(torch.uint8).cpu().numpy().tobytes())  # host: explicit copy
        self._parts[name] = h.digest()

    def hexdigest(self) -> str:
        h = hashlib.blake2b(self._head, digest_size=16)
        for name in sorted(self._parts):
            h.update(self._parts[name])
        return h.hexdigest()
