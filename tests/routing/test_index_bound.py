"""``PrefixIndex``'s memory bound (issue 27: one event entry of 300k hashes grew the router by
135 MiB): at most ``max_entries`` (hash, replica) entries; past it the replica holding the most
loses its least recently stored entries, so one replica's flood never evicts another's view."""

from __future__ import annotations

import pytest

from pagedkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.routing import PrefixIndex


def hashes(start: int, n: int) -> tuple[bytes, ...]:
    return tuple(i.to_bytes(32, "big") for i in range(start, start + n))


def test_a_flood_evicts_only_the_flooding_replica():
    ix = PrefixIndex(max_entries=1000)
    small = hashes(0, 200)
    ix.apply("small", [BlockStored(small, None, 16)])
    ix.apply("flood", [BlockStored(hashes(10_000, 300_000), None, 16)])
    assert ix.num_entries == 1000 and ix.num_blocks("flood") == 800
    assert ix.holds("small") == set(small)  # untouched
    assert ix.match(list(small)) == {"small": 200}
    assert ix.num_evicted == 300_000 - 800 and ix.evicted == {"flood": 300_000 - 800}
    # the flood keeps its newest entries (the oldest went first)
    assert ix.holds("flood") == set(hashes(10_000 + 300_000 - 800, 800))


def test_a_replica_within_its_share_is_never_evicted():
    ix = PrefixIndex(max_entries=900)
    for r in range(3):  # each holds exactly its share
        ix.apply(f"r{r}", [BlockStored(hashes(r * 1000, 300), None, 16)])
    ix.apply("r0", [BlockStored(hashes(5000, 50), None, 16)])  # r0 grows past its share
    assert [ix.num_blocks(f"r{r}") for r in range(3)] == [300, 300, 300]  # its own oldest went
    assert ix.evicted == {"r0": 50}


def test_stored_again_is_recently_updated_and_removals_free_room():
    ix = PrefixIndex(max_entries=3)
    a, b, c, d = hashes(0, 4)
    ix.apply("r", [BlockStored((a, b, c), None, 16)])
    ix.apply("r", [BlockStored((a,), None, 16, medium="host")])  # a: the newest now
    ix.apply("r", [BlockStored((d,), c, 16)])  # over the bound: b, the oldest, goes
    assert ix.holds("r") == {a, c, d} and ix.num_evicted == 1
    ix.apply("r", [BlockRemoved((c,)), BlockRemoved((a,))])  # a is still on the host
    assert ix.holds("r") == {a, d} and ix.num_entries == 2
    ix.apply("r", [BlockStored((b,), None, 16)])  # room again: nothing evicted
    assert ix.num_evicted == 1 and ix.match([a]) == {"r": 1}
    ix.apply("r", [BlockRemoved((a,), medium="host")])
    assert ix.match([a]) == {} and ix.num_entries == 2


def test_shared_hashes_count_once_per_replica_and_clear_and_drop_free_them():
    ix = PrefixIndex(max_entries=10)
    shared = hashes(0, 4)
    ix.apply("r0", [BlockStored(shared, None, 16)])
    ix.apply("r1", [BlockStored(shared, None, 16), BlockStored(shared, None, 16, medium="host")])
    assert ix.num_entries == 8 and ix.match(list(shared)) == {"r0": 4, "r1": 4}
    ix.apply("r1", [AllBlocksCleared()])
    assert ix.num_entries == 4 and ix.match(list(shared)) == {"r0": 4}
    ix.drop_replica("r0")
    assert ix.num_entries == 0 and ix.match(list(shared)) == {}
    assert ix._holders == {}  # nothing left behind


def test_max_entries_must_be_positive():
    with pytest.raises(ValueError, match="max_entries"):
        PrefixIndex(max_entries=0)
