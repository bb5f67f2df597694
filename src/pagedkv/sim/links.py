"""Host links: what a swap transfer between GPU and host memory costs.

A transfer costs a fixed ``per_transfer_s`` (submitting one ``cudaMemcpyAsync`` and setting up
its DMA) plus its bytes over the link's bandwidth. Swap preemption moves whole KV blocks, one
transfer per block as the first article counts them; a real engine that keeps one K and one V
tensor per layer (vLLM v0) issues ``2 * num_layers`` transfers per block, which
``transfer_time_s(..., transfers_per_block=...)`` can price.

Sources and assumptions:

- Raw bandwidth per direction of an x16 link: PCIe 4.0 runs 16 GT/s a lane, PCIe 5.0 32 GT/s,
  both with 128b/130b encoding: 16 lanes x 16 GT/s x 128/130 / 8 = 31.5 GB/s (PCIe 4) and
  63.0 GB/s (PCIe 5) (PCI-SIG base specifications 4.0 and 5.0).
- Effective bandwidth: we assume 80 % of raw for large pinned-memory copies (packet headers
  and flow control; NVIDIA's ``bandwidthTest`` on PCIe 4 A100 systems reports about
  25 GB/s host to device), so 25.2 GB/s and 50.4 GB/s.
- ``per_transfer_s`` = 10 us: an assumption of the order of the few microseconds a
  ``cudaMemcpyAsync`` call takes to submit plus the DMA engine's start-up. It is what makes
  small blocks expensive; change it with ``Link(...)`` to test the sensitivity.
- Which link each GPU preset sits on: A100 (SXM4 and PCIe) and L4 are PCIe 4.0 devices;
  H100 and H200 SXM boards connect to the host over PCIe 5.0 (the vendors' datasheets).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedkv.errors import UsageError

_PCIE_EFFICIENCY = 0.8  # effective / raw bandwidth for large pinned copies (assumed)
_PER_TRANSFER_S = 10e-6  # one cudaMemcpyAsync submission + DMA start-up (assumed)


@dataclass(frozen=True)
class Link:
    """A host link: ``bandwidth_bytes_per_s`` per direction and a fixed cost per transfer."""

    name: str
    bandwidth_bytes_per_s: float
    per_transfer_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise UsageError(f"link {self.name!r}: bandwidth must be > 0 bytes/s")
        if not self.per_transfer_s >= 0:
            raise UsageError(f"link {self.name!r}: per-transfer cost must be >= 0 s")

    def transfer_time_s(
        self, num_blocks: int, block_bytes: int, transfers_per_block: int = 1
    ) -> float:
        """Seconds to move ``num_blocks`` blocks of ``block_bytes`` each, one after another,
        in ``transfers_per_block`` equal transfers per block."""
        num_transfers = num_blocks * transfers_per_block
        return num_transfers * self.per_transfer_s + num_blocks * block_bytes / (
            self.bandwidth_bytes_per_s
        )


def _pcie(name: str, gt_per_s: float) -> Link:
    raw = 16 * gt_per_s * 1e9 * 128 / 130 / 8
    return Link(
        name,
        raw * _PCIE_EFFICIENCY,
        _PER_TRANSFER_S,
        f"x16 at {gt_per_s:g} GT/s, 128b/130b: {raw / 1e9:.1f} GB/s raw, "
        f"{_PCIE_EFFICIENCY:.0%} effective (assumed); {_PER_TRANSFER_S * 1e6:g} us a transfer",
    )


LINKS: dict[str, Link] = {
    link.name: link for link in (_pcie("pcie4-x16", 16), _pcie("pcie5-x16", 32))
}

# GPU preset name prefix -> its host link (first match wins).
_GPU_LINKS: tuple[tuple[str, str], ...] = (
    ("a100", "pcie4-x16"),
    ("h100", "pcie5-x16"),
    ("h200", "pcie5-x16"),
    ("l4", "pcie4-x16"),
)


def get_link(name: str) -> Link:
    """A preset by name (case-insensitive); UsageError lists the presets."""
    for key, link in LINKS.items():
        if key == name.lower():
            return link
    raise UsageError(f"unknown link {name!r}; presets: {', '.join(LINKS)}")


def host_link_for_gpu(gpu_name: str) -> Link:
    """The host link of a GPU (preset name or any name starting with the family): A100 and L4
    on PCIe 4.0, H100 and H200 (SXM) on PCIe 5.0. Any other GPU is assumed to sit on PCIe 4.0;
    the returned link's ``source`` then says so (print it)."""
    key = gpu_name.lower()
    for prefix, link_name in _GPU_LINKS:
        if key.startswith(prefix):
            return LINKS[link_name]
    base = LINKS["pcie4-x16"]
    return replace(
        base, source=f"host link of {gpu_name!r} unknown: assumed pcie4-x16 ({base.source})"
    )


# A copy inside device memory reads and writes each byte; a copy kernel of the engine's kind
# (one launch per K or V pool tensor, every pair of the step in it) reaches about this share of
# the datasheet bandwidth. Both assumed, like the PCIe numbers above; see docs/prefix_cache.md.
_DEVICE_COPY_EFFICIENCY = 0.8
_DEVICE_COPY_LAUNCH_S = 5e-6


@dataclass(frozen=True)
class DeviceCopy:
    """What a step's device-to-device copies cost (a partial prefix hit's slots): one batch of
    ``launches`` kernel calls over ``link`` (device memory as a link: bandwidth = bytes copied
    per second, read and write counted)."""

    link: Link
    launches: int  # per step with any copy: one per K or V pool tensor (2 x layers)

    def time_s(self, num_bytes: int) -> float:
        """Seconds to copy ``num_bytes`` in one step (``Link.transfer_time_s`` of one batch)."""
        return self.link.transfer_time_s(1, num_bytes, self.launches)


def device_copy(gpu_name: str, mem_bandwidth_bytes_per_s: float, num_layers: int) -> DeviceCopy:
    """The device copies of an engine with ``num_layers`` layers on a GPU of that bandwidth."""
    bandwidth = mem_bandwidth_bytes_per_s * _DEVICE_COPY_EFFICIENCY / 2  # read + write
    link = Link(
        f"{gpu_name} memory",
        bandwidth,
        _DEVICE_COPY_LAUNCH_S,
        f"device memory at {_DEVICE_COPY_EFFICIENCY:.0%} of {mem_bandwidth_bytes_per_s / 1e9:,.0f}"
        f" GB/s, read + write (assumed); {_DEVICE_COPY_LAUNCH_S * 1e6:g} us a launch, "
        f"{2 * max(1, num_layers)} launches a step",
    )
    return DeviceCopy(link, 2 * max(1, num_layers))
