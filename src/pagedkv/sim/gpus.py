"""GPU presets from the vendors' public spec sheets (dense, no sparsity).

Memory is the marketed capacity in decimal gigabytes (an "80GB" A100 is counted as 80e9
bytes); bandwidth is peak HBM/GDDR bandwidth; compute is peak dense BF16 tensor throughput.
A roofline over these numbers is an upper bound on speed: real kernels reach a fraction of it.
``num_sms`` (streaming multiprocessors, from the same sheets / NVIDIA's architecture
whitepapers) sizes how many attention block walks run at once (``sim/kernel_cost.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import UsageError

GB = 10**9
TB = 10**12


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    mem_bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    source: str
    num_sms: int = 108

    def __post_init__(self) -> None:
        if min(self.memory_bytes, self.mem_bandwidth_bytes_per_s, self.peak_flops_per_s) <= 0:
            raise UsageError(f"GPU {self.name!r}: memory, bandwidth and compute must be > 0")
        if self.num_sms < 1:
            raise UsageError(f"GPU {self.name!r}: num_sms must be >= 1, got {self.num_sms}")


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        # The PagedAttention paper's GPU (OPT-13B on one A100 with 40 GB)
        GPUSpec("A100-40GB", 40 * GB, 1.555 * TB, 312e12, "NVIDIA A100 datasheet, SXM 40GB", 108),
        GPUSpec("A100-80GB", 80 * GB, 2.039 * TB, 312e12, "NVIDIA A100 datasheet, SXM 80GB", 108),
        GPUSpec("H100-80GB", 80 * GB, 3.35 * TB, 989e12, "NVIDIA H100 datasheet, SXM", 132),
        GPUSpec("H200-141GB", 141 * GB, 4.8 * TB, 989e12, "NVIDIA H200 datasheet, SXM", 132),
        GPUSpec("L4", 24 * GB, 300 * GB, 121e12, "NVIDIA L4 datasheet", 58),
    )
}


def get_gpu(name: str) -> GPUSpec:
    """A preset by name (case-insensitive); ValueError lists the presets."""
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise UsageError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}")
