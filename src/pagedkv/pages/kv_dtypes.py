"""Storage formats of KV values: how many bytes a vector of n values takes.

Block-scaled formats (MXFP8, FP4) store one scale per group of values *along the vector*
(a head's ``head_dim`` values, or an MLA latent), so a vector whose length is not a multiple of
the group size still pays a whole scale for its last, partial group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import UsageError


@dataclass(frozen=True)
class KVDtype:
    """One KV storage format.

    ``bits_per_value`` is the payload width; ``scale_group_size`` values share one scale of
    ``scale_bytes`` bytes (0 / 0 for unscaled formats).
    """

    name: str
    bits_per_value: int
    scale_group_size: int = 0
    scale_bytes: int = 0

    def vector_bytes(self, num_values: int) -> int:
        """Bytes of one stored vector of ``num_values`` values, scales included.

        The payload is rounded up to whole bytes per vector: a kernel cannot address half a byte
        at a vector boundary.
        """
        if num_values < 0:
            raise UsageError(f"num_values must be >= 0, got {num_values}")
        payload_bytes = math.ceil(num_values * self.bits_per_value / 8)
        if self.scale_group_size == 0:
            return payload_bytes
        num_groups = math.ceil(num_values / self.scale_group_size)
        return payload_bytes + num_groups * self.scale_bytes


# MXFP8: OCP microscaling, E8M0 scale (1 byte) per 32 values.
# FP4: NVFP4-style, an FP8 scale (1 byte) per 16 values (the article's "FP4, one scale per 16").
KV_DTYPES: dict[str, KVDtype] = {
    "fp32": KVDtype("fp32", 32),
    "fp16": KVDtype("fp16", 16),
    "bf16": KVDtype("bf16", 16),
    "fp8": KVDtype("fp8", 8),
    "mxfp8": KVDtype("mxfp8", 8, scale_group_size=32, scale_bytes=1),
    "fp4": KVDtype("fp4", 4, scale_group_size=16, scale_bytes=1),
}

# Spellings found in Hugging Face configs (`torch_dtype`) and on command lines.
_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "nvfp4": "fp4",
}


# The dtypes the torch engine computes and stores KV in, by the names its flags use
# (``get_kv_dtype`` maps them to formats; model/loader.py maps them to torch dtypes).
ENGINE_DTYPES = ("float32", "bfloat16")


def get_kv_dtype(name: str) -> KVDtype:
    """The format named ``name`` (case-insensitive, HF spellings accepted); ValueError if none."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in KV_DTYPES:
        known = ", ".join(KV_DTYPES)
        raise UsageError(f"unknown KV dtype {name!r} (known: {known})")
    return KV_DTYPES[key]
