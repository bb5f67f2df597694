"""``StoreCounters``: what the store tier did, for the engine's stats and ``/metrics``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pagedkv.kvstore.codec import REJECT_REASONS


@dataclass
class StoreCounters:
    """Running totals (plain ints, only ever growing). The step's thread and the writer thread
    both add to them, so additions go through ``add`` (one lock); reads are plain."""

    hit_blocks: int = 0  # blocks loaded from the store instead of recomputed
    hit_tokens: int = 0
    bytes_read: int = 0  # payload bytes fetched (verified or not)
    bytes_written: int = 0  # payload bytes the store acknowledged
    blocks_written: int = 0
    writes_dropped: int = 0  # blocks not written: store down, or the write queue full
    errors: int = 0  # store operations that failed (connection refused, timeout, ...)
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def as_dict(self) -> dict[str, int]:
        """Flat ``{name: value}`` (rejections as ``rejected_<reason>``), a consistent copy."""
        with self._lock:
            out = {
                k: getattr(self, k)
                for k in (
                    "hit_blocks",
                    "hit_tokens",
                    "bytes_read",
                    "bytes_written",
                    "blocks_written",
                    "writes_dropped",
                    "errors",
                )
            }
            out.update({f"rejected_{r}": n for r, n in self.rejected.items()})
        return out


def store_rows(items: tuple[tuple[str, int], ...]) -> list[tuple[str, str]]:
    """The store's lines of a stats table (none without a store): ``items`` as in
    ``EngineSnapshot.kv_store``."""
    if not items:
        return []
    c = dict(items)
    rejected = sum(n for k, n in c.items() if k.startswith("rejected_"))
    read_mib, written_mib = c["bytes_read"] / 2**20, c["bytes_written"] / 2**20
    return [
        ("KV store read / written", f"{read_mib:.1f} / {written_mib:.1f} MiB"),
        ("KV store blocks written / dropped", f"{c['blocks_written']} / {c['writes_dropped']}"),
        ("KV store payloads rejected / errors", f"{rejected} / {c['errors']}"),
    ]
