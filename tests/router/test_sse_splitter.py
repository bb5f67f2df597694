"""``SSESplitter`` (router/bounded.py): the events ``split(b"\\n\\n")`` gives, however the bytes are
cut into chunks; work per chunk in proportion to the chunk, not to the pending event (issue 27:
an event without its blank line took 11.8 CPU-s for 23 MiB, each chunk re-copying all pending
bytes); and a cap per event."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from pagedkv.router.bounded import EventTooLarge, SSESplitter

STREAM = b'data: {"a":1}\n\n\n\ndata: x\ndata: y\n\ndata: [DONE]\n\n\ntail\n'


def _reference(data: bytes) -> tuple[list[bytes], bytes]:
    *events, rest = data.split(b"\n\n")
    return [e + b"\n\n" for e in events], rest


@pytest.mark.parametrize("seed", range(40))
def test_any_chunking_gives_the_events_of_split(seed):
    rng = random.Random(seed)
    data = b"".join(rng.choice([STREAM, b"\n", b"\n\n", b"ab", b"\n\n\n"]) for _ in range(30))
    cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, rng.randint(1, 40))))
    splitter, events = SSESplitter(1 << 20), []
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        events += splitter.feed(data[start:end])
    expected, rest = _reference(data)
    assert events == expected
    assert splitter.num_pending_bytes == len(rest)


def test_a_feed_allocates_for_its_chunk_not_for_the_pending_event():
    splitter, chunk = SSESplitter(64 << 20), b"x" * 4096
    for _ in range(1024):  # 4 MiB pending, no blank line yet
        assert splitter.feed(chunk) == []
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        splitter.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Re-joining the pending bytes (the old splitter's `pending + chunk`) would be 4 MiB here.
    assert peak - before < 64 << 10, peak - before
    assert splitter.feed(b"\n\n") == [chunk * 1025 + b"\n\n"]  # joined once, when whole


def test_an_event_over_the_cap_is_refused_once_the_pending_bytes_pass_it():
    splitter = SSESplitter(10_000)
    for _ in range(9):
        splitter.feed(b"x" * 1000)
    with pytest.raises(EventTooLarge, match="more than 10000 bytes"):
        splitter.feed(b"x" * 1001)
    whole = SSESplitter(10_000)  # also an event that ends inside the chunk that passes the cap
    with pytest.raises(EventTooLarge):
        whole.feed(b"x" * 10_000 + b"\n\n")
    assert SSESplitter(10_002).feed(b"x" * 10_000 + b"\n\n") == [b"x" * 10_000 + b"\n\n"]
