"""The page-format handshake of a prefill/decode pair, through the shared store.

Each instance publishes, under ``pagedkv:pd:<group>:<role>``, what a KV page of its pool
means (``PageFormat``) and which model wrote it. A decode instance reads the prefill side's
record at start-up and refuses to start when they differ: a block read with another block
size, dtype, layer count or head layout is silently wrong, so a warning is not enough.
With ``--kv-import relayout`` the block size may differ (the decode side re-pages the
prefill side's blocks on import); every other field must still match. The tensor-parallel
sizes may differ: the store keeps whole blocks (every KV head), which each side's ranks join
and split by head slices (``engine/ranks/kv_ranks.py``), so the pages are compared as the
whole model's (``page_format.whole_of``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagedkv import untrusted as u
from pagedkv.errors import UsageError
from pagedkv.pages.page_format import PageFormat, format_differences

KEY_PREFIX = "pagedkv:pd"
POLL_S = 0.2
# Fields a relayout import can bridge: the block size is how tokens are grouped, not what a
# token's KV record is.
RELAYOUT_BRIDGES = frozenset({"block_size"})


@dataclass(frozen=True)
class PeerRecord:
    """What one instance of a pair published about itself."""

    role: str
    model: str
    page_format: PageFormat
    pid: int
    host: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "role": self.role,
                "model": self.model,
                "pid": self.pid,
                "host": self.host,
                "page_format": self.page_format.to_dict(),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> PeerRecord:
        """ValueError (an ``UntrustedInput``, naming the field) on anything that is not a
        record this version wrote: the store is shared, so its bytes are bounded (size,
        nesting, each field's type and range) before use."""
        try:
            data = u.as_object(
                u.parse_json(text, max_bytes=64 << 10, what="the record"), "the record"
            )
            pages = u.get_object(data, "page_format")
            checked: dict[str, int | str] = {}
            for name, spec in PageFormat.__dataclass_fields__.items():
                checked[name] = (
                    u.get_int(pages, name, lo=0, hi=1 << 40, at="page_format")
                    if spec.type in (int, "int")
                    else u.get_str(pages, name, max_len=64, at="page_format")
                )
            return cls(
                role=u.get_str(data, "role", max_len=64),
                model=u.get_str(data, "model", max_len=1024),
                page_format=PageFormat.from_dict(dict(pages, **checked)),
                pid=u.get_int(data, "pid", lo=0, hi=1 << 32),
                host=u.get_str(data, "host", max_len=255),
            )
        except (ValueError, UsageError) as exc:  # UsageError: page format keys differ
            raise u.UntrustedInput(f"not a pagedkv page-format record: {exc}") from None


def record_key(group: str, role: str) -> str:
    return f"{KEY_PREFIX}:{group}:{role}"


def own_record(role: str, model: str, page_format: PageFormat) -> PeerRecord:
    return PeerRecord(role, model, page_format, os.getpid(), socket.gethostname())


def differences(ours: PeerRecord, theirs: PeerRecord, kv_import: str) -> list[str]:
    """Every field that stops ``ours`` from reading ``theirs``' pages, both values named:
    ``"block_size 32 (decode) vs 16 (prefill)"``. Empty when they are compatible."""
    bridged = RELAYOUT_BRIDGES if kv_import == "relayout" else frozenset()
    return _named_differences(
        (ours.model, ours.page_format.to_dict(), ours.role),
        (theirs.model, theirs.page_format.to_dict(), theirs.role),
        bridged,
    )


def _named_differences(
    mine: tuple[str | None, Mapping[str, object], str],
    theirs: tuple[str | None, Mapping[str, object], str],
    bridged: frozenset[str] = frozenset(),
) -> list[str]:
    """``(model, page format mapping, label)`` of each side -> ``"NAME MINE (LABEL) vs THEIRS
    (LABEL)"`` for the model and every page-format field (``format_differences``, across
    ranks: the whole model's pages) that differ."""
    (my_model, my_pages, me), (their_model, their_pages, them) = mine, theirs
    diffs = []
    if my_model != their_model:
        diffs.append(f"model {my_model!r} ({me}) vs {their_model!r} ({them})")
    for name, a, b in format_differences(my_pages, their_pages, bridged, across_ranks=True):
        diffs.append(f"{name} {a} ({me}) vs {b} ({them})")
    return diffs


def _hint(kv_import: str, diffs: list[str]) -> str:
    return "start both with the same model, --dtype and --block-size" + (
        ""
        if kv_import == "relayout" or diffs[0].startswith("model")
        else ", or the decode side with --kv-import relayout if only the block size differs"
    )


def check_peer(ours: PeerRecord, theirs: PeerRecord, kv_import: str, group: str) -> None:
    """UsageError (one line, both sides' values) unless ``ours`` may read ``theirs``' pages."""
    diffs = differences(ours, theirs, kv_import)
    if not diffs:
        return
    raise UsageError(
        f"KV page format mismatch in P/D group {group!r}: {'; '.join(diffs)} "
        f"({_hint(kv_import, diffs)})",
        "page_format",
        code="page_format_mismatch",
    )


def check_live(
    ours: PeerRecord,
    record: PeerRecord,
    live: tuple[str | None, Mapping[str, object]],
    kv_import: str,
    group: str,
) -> None:
    """The prefill instance's own answer now (``live``: its model identity and page format,
    from ``GET /pagedkv/info``) against this instance and against the store's ``record`` of
    it. UsageError (one line, both values of each field named) when this instance cannot read
    the live instance's pages, or when the record is stale (differs from the live instance in
    anything: it was left by an instance restarted with other flags, or by another prefill
    instance of the group). The live answer is the truth this instance is checked against;
    without a stale record the message is ``check_peer``'s."""
    now = (live[0], live[1], "prefill")
    theirs = _named_differences(
        (ours.model, ours.page_format.to_dict(), ours.role),
        now,
        RELAYOUT_BRIDGES if kv_import == "relayout" else frozenset(),
    )
    stale = _named_differences((record.model, record.page_format.to_dict(), "store record"), now)
    if not theirs and not stale:
        return
    key = record_key(group, record.role)
    parts = [f"KV page format mismatch in P/D group {group!r}"]
    if theirs:
        parts.append(": " + "; ".join(theirs))
    if stale:
        parts.append(
            ("; " if theirs else ": ")
            + f"the store's record {key} is stale ("
            + "; ".join(stale)
            + "): restart the prefill instance, which publishes it "
            "anew, and check that no other prefill instance shares --pd-group"
        )
    if theirs:
        parts.append(f" ({_hint(kv_import, theirs)})")
    raise UsageError("".join(parts), "page_format", code="page_format_mismatch")


class Handshake:
    """Publish our record and read the peer's, over ``client`` (a ``redis.Redis``; any object
    with ``get``/``set`` works). Store errors become ``UsageError``: a pair cannot start
    without its store."""

    def __init__(self, client, url: str, group: str) -> None:
        self._client, self._url, self._group = client, url, group

    def publish(self, record: PeerRecord) -> None:
        try:
            self._client.set(record_key(self._group, record.role), record.to_json())
        except Exception as exc:  # noqa: BLE001 - any client error means: no store
            raise UsageError(
                f"cannot publish the page format to {self._url}: {exc}", "kv_store"
            ) from None

    def read(self, role: str) -> PeerRecord | None:
        """The ``role`` instance's record now, or None when there is none (a Redis restarted
        since it was published); ``UsageError`` when the store cannot be read or the record is
        not one (the store's data is untrusted)."""
        key = record_key(self._group, role)
        try:
            raw = self._client.get(key)
        except Exception as exc:  # noqa: BLE001 - any client error means: no store
            raise UsageError(
                f"cannot read the {role} instance's page format from {self._url}: {exc}", "kv_store"
            ) from None
        if raw is None:
            return None
        try:
            return PeerRecord.from_json(raw)
        except ValueError as exc:
            raise UsageError(f"{key} in {self._url}: {exc}", "kv_store") from None

    def wait_for(
        self, role: str, wait_s: float, clock: Callable[[], float] = time.monotonic
    ) -> PeerRecord:
        """The ``role`` instance's record; UsageError if none appears within ``wait_s``."""
        deadline = clock() + wait_s
        key = record_key(self._group, role)
        while True:
            try:
                raw = self._client.get(key)
            except Exception as exc:  # noqa: BLE001
                raise UsageError(
                    f"cannot read the {role} instance's page format from {self._url}: {exc}",
                    "kv_store",
                ) from None
            if raw is not None:
                try:
                    return PeerRecord.from_json(raw)
                except ValueError as exc:
                    raise UsageError(f"{key} in {self._url}: {exc}", "kv_store") from None
            if clock() >= deadline:
                raise UsageError(
                    f"no {role} instance published its page format in {self._url} "
                    f"(P/D group {self._group!r}) within {wait_s:g} s: start it first, "
                    "with the same --kv-store and --pd-group",
                    "kv_store",
                )
            time.sleep(POLL_S)
