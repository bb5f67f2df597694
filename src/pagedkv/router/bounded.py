"""What the router reads of a replica's answer, within caps: its server-sent events
(``SSESplitter``, incrementally, a cap per event) and a whole body (``read_at_most``).

A replica's stream is untrusted input (docs/architecture.md, rule 7): one that never sends the blank line
ending an event must not make the router hold, or re-scan, everything it sent. ``SSESplitter``
therefore keeps the pending event as the chunks it arrived in (joined once, when the event is
whole) and searches each new chunk only, plus the one byte before it: the separator ``\\n\\n``
is two bytes, so it can straddle two chunks by one. Work and memory per event are linear in
its size, and an event over ``max_event_bytes`` raises ``EventTooLarge`` as soon as the
pending bytes pass the cap (the router holds at most the cap plus one chunk).

Events end with ``\\n\\n``, as ``pagedkv serve`` writes them; ``\\r\\n`` line ends are not
recognized (a stream using them reaches the cap and is refused, clearly, rather than hanging).
"""

from __future__ import annotations

import httpx

from pagedkv.router.config import DEFAULT_MAX_EVENT_BYTES

SEPARATOR = b"\n\n"


class EventTooLarge(Exception):
    """A replica's event (or its pending part) is over the cap; ``max_event_bytes`` says which."""

    def __init__(self, num_bytes: int, max_event_bytes: int) -> None:
        super().__init__(
            f"an event of more than {max_event_bytes} bytes (at least {num_bytes} "
            "bytes without the blank line that ends an event)"
        )
        self.num_bytes, self.max_event_bytes = num_bytes, max_event_bytes


class SSESplitter:
    """Bytes in, whole server-sent events out, each with its ending ``\\n\\n`` (the same events
    ``data.split(b"\\n\\n")`` would give, empty ones included). ``feed`` raises
    ``EventTooLarge`` for an event over ``max_event_bytes`` (separator included); after it,
    the stream is to be abandoned (the splitter is not fed again)."""

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        if max_event_bytes < len(SEPARATOR):
            raise ValueError(f"max_event_bytes must be >= {len(SEPARATOR)}, got {max_event_bytes}")
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # the pending event's bytes, in the chunks they came in
        self._num_pending_bytes = 0

    @property
    def num_pending_bytes(self) -> int:
        """Bytes held of the event not yet ended."""
        return self._num_pending_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        events: list[bytes] = []
        pos = 0
        # The separator straddling the previous chunk and this one.
        if self._parts and self._parts[-1].endswith(b"\n") and chunk.startswith(b"\n"):
            events.append(self._take(b"\n"))
            pos = 1
        while (end := chunk.find(SEPARATOR, pos)) != -1:
            events.append(self._take(chunk[pos : end + len(SEPARATOR)]))
            pos = end + len(SEPARATOR)
        if pos < len(chunk):
            rest = chunk[pos:] if pos else chunk
            self._check(self._num_pending_bytes + len(rest))
            self._parts.append(rest)
            self._num_pending_bytes += len(rest)
        return events

    def _take(self, last: bytes) -> bytes:
        """The pending event ended by ``last``; the pending bytes are emptied."""
        self._check(self._num_pending_bytes + len(last))
        event = b"".join([*self._parts, last]) if self._parts else last
        self._parts, self._num_pending_bytes = [], 0
        return event

    def _check(self, num_bytes: int) -> None:
        if num_bytes > self.max_event_bytes:
            raise EventTooLarge(num_bytes, self.max_event_bytes)


async def read_head(resp: httpx.Response, num_bytes: int) -> bytes:
    """The body's first ``num_bytes`` bytes; the rest is never read."""
    head = b""
    async for chunk in resp.aiter_bytes():
        head += chunk[: num_bytes - len(head)]
        if len(head) >= num_bytes:
            break
    await resp.aclose()
    return head


async def read_at_most(resp: httpx.Response, max_bytes: int) -> bytes | None:
    """The body, or None as soon as it passes ``max_bytes`` (then the response is closed:
    the rest is never read, and what was read is dropped, never joined)."""
    parts: list[bytes] = []
    num_bytes = 0
    async for chunk in resp.aiter_bytes():
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            parts.clear()
            await resp.aclose()
            return None
        parts.append(chunk)
    return b"".join(parts)
