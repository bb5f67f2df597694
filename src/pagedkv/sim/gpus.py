"""GPU presets from the vendors' public spec sheets (dense, no sparsity).

Memory is the marketed capacity in decimal gigabytes (an "80GB" A100 is counted as 80e9
bytes); bandwidth is peak HBM/GDDR bandwidth; compute is peak dense BF16/FP16 tensor
throughput. A roofline over these numbers is an upper bound on speed: real kernels reach a
fraction of it, which the fitted clock (``sim/vllm_class/clock.py``) measures. ``num_sms``
(streaming multiprocessors, from the same sheets / NVIDIA's architecture whitepapers) sizes how
many attention CTAs run at once. ``link_bytes_per_s`` is the GPU-to-GPU bandwidth per
direction that a tensor-parallel all-reduce uses (NVLink on SXM boards and NVLink-bridged
pairs, else PCIe x16). ``arch`` picks the fitted clock a GPU without one of its own borrows
(``sim/clock_presets.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import UsageError

GB = 10**9
TB = 10**12
PCIE4_X16 = 31.5 * GB  # 16 lanes x 16 GT/s x 128/130 / 8, per direction
PCIE5_X16 = 63.0 * GB


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    mem_bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    source: str
    num_sms: int = 108
    link_bytes_per_s: float = PCIE4_X16
    arch: str = "ampere"

    def __post_init__(self) -> None:
        rates = (self.memory_bytes, self.mem_bandwidth_bytes_per_s, self.peak_flops_per_s)
        if min(rates) <= 0 or not self.link_bytes_per_s > 0:
            raise UsageError(f"GPU {self.name!r}: memory, bandwidth, compute and link must be > 0")
        if self.num_sms < 1:
            raise UsageError(f"GPU {self.name!r}: num_sms must be >= 1, got {self.num_sms}")


_NVLINK3 = 300 * GB  # A100 SXM: 600 GB/s total, 12 links
_NVLINK4 = 450 * GB  # H100/H200 SXM: 900 GB/s total, 18 links
_NVLINK5 = 900 * GB  # B200: 1.8 TB/s total
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("A10", 24 * GB, 600 * GB, 125e12, "NVIDIA A10 datasheet (PCIe)", 72),
        GPUSpec(
            "A40",
            48 * GB,
            696 * GB,
            149.7e12,
            "NVIDIA A40 datasheet (PCIe; NVLink bridge 112.5 GB/s for a pair)",
            84,
            56.25 * GB,
        ),
        GPUSpec("L4", 24 * GB, 300 * GB, 121e12, "NVIDIA L4 datasheet", 58, arch="ada"),
        GPUSpec("L40S", 48 * GB, 864 * GB, 362e12, "NVIDIA L40S datasheet", 142, arch="ada"),
        # The PagedAttention paper's GPU (OPT-13B on one A100 with 40 GB)
        GPUSpec(
            "A100-40GB",
            40 * GB,
            1.555 * TB,
            312e12,
            "NVIDIA A100 datasheet, SXM 40GB",
            108,
            _NVLINK3,
        ),
        GPUSpec(
            "A100-80GB",
            80 * GB,
            2.039 * TB,
            312e12,
            "NVIDIA A100 datasheet, SXM 80GB",
            108,
            _NVLINK3,
        ),
        GPUSpec(
            "H100-80GB",
            80 * GB,
            3.35 * TB,
            989e12,
            "NVIDIA H100 datasheet, SXM",
            132,
            _NVLINK4,
            "hopper",
        ),
        GPUSpec(
            "H100-PCIe",
            80 * GB,
            2.0 * TB,
            756e12,
            "NVIDIA H100 datasheet, PCIe",
            114,
            PCIE5_X16,
            "hopper",
        ),
        GPUSpec(
            "H200-141GB",
            141 * GB,
            4.8 * TB,
            989e12,
            "NVIDIA H200 datasheet, SXM",
            132,
            _NVLINK4,
            "hopper",
        ),
        GPUSpec(
            "B200",
            180 * GB,
            8.0 * TB,
            2.25e15,
            "NVIDIA HGX B200 datasheet (per GPU)",
            148,
            _NVLINK5,
            "blackwell",
        ),
    )
}

# Other spellings: the folder names of published profiles (Vidur's a100 is an 80 GB card,
# its h100 an SXM "DGX" one) and the board names users type.
ALIASES = {
    "a100": "A100-80GB",
    "a100-80gb-sxm": "A100-80GB",
    "a100-40gb-sxm": "A100-40GB",
    "h100": "H100-80GB",
    "h100-sxm": "H100-80GB",
    "h100-80gb-sxm": "H100-80GB",
    "h200": "H200-141GB",
    "h200-sxm": "H200-141GB",
}


def get_gpu(name: str) -> GPUSpec:
    """A preset by name or alias (case-insensitive); UsageError lists the presets."""
    key = ALIASES.get(name.lower(), name).lower()
    for preset, spec in GPUS.items():
        if preset.lower() == key:
            return spec
    raise UsageError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}")
