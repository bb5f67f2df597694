"""``FairQueue``: the engine requests of many HTTP requests, handed out one per HTTP request in
turn (round-robin), so that a small request is not stuck behind every prompt of a giant one.

Pure bookkeeping, no engine and no threads: the engine loop owns one and uses it on its own
thread only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from itertools import count
from typing import Generic, Protocol, TypeVar


class _HasId(Protocol):
    @property
    def request_id(self) -> str: ...


T = TypeVar("T", bound=_HasId)


class FairQueue(Generic[T]):
    """Items grouped by HTTP request; ``pop`` takes the next group's oldest item and sends
    that group to the back. ``remove`` (an abort) is O(1); a removed item is skipped later."""

    def __init__(self) -> None:
        self._items: dict[str, T] = {}  # request id -> item, for every item still queued
        self._groups: OrderedDict[int, deque[str]] = OrderedDict()  # group -> its ids, in order
        self._group_keys = count()

    def __len__(self) -> int:
        return len(self._items)

    def add_group(self, items: Iterable[T]) -> None:
        """Queue one HTTP request's items, behind the groups already queued."""
        items = list(items)
        if items:
            self._groups[next(self._group_keys)] = deque(i.request_id for i in items)
            self._items.update((i.request_id, i) for i in items)

    def remove(self, request_id: str) -> bool:
        """Take ``request_id`` out of the queue; False if it is not queued."""
        return self._items.pop(request_id, None) is not None

    def pop(self) -> T | None:
        """The next item round-robin over groups; None when the queue is empty."""
        while self._groups:
            key, ids = next(iter(self._groups.items()))
            item = None
            while ids and item is None:
                item = self._items.pop(ids.popleft(), None)  # None: removed while queued
            if ids:
                self._groups.move_to_end(key)
            else:
                del self._groups[key]
            if item is not None:
                return item
        return None

    def drain(self) -> Iterator[T]:
        """Every item still queued (the queue is empty afterwards)."""
        items, self._items = self._items, {}
        self._groups.clear()
        yield from items.values()
