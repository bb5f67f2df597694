"""The replicas' facts (``GET /pagedkv/info``) and the rule for which replicas may share one
router.

A router hashes each request once, with one block size and one hash function, and reads every
replica's KV events against those hashes; it tokenizes once, with one tokenizer. Replicas that
differ in any of ``COMPARED_FIELDS`` (or any field of the page format) would make its index lie,
so they are refused: at start-up the router exits (status 2) with one line naming both replicas
and the field; a replica that comes back later with another format is kept out (logged and
counted in ``/metrics``, see ``health.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pagedkv.errors import UsageError
from pagedkv.pages.page_format import format_differences

INFO_PATH = "/pagedkv/info"
# The replica's own facts beyond the page format (whose fields and comparison
# ``pages/page_format.py`` owns), checked first and in this order, so the message names the most
# telling difference first.
COMPARED_FIELDS = ("block_size", "hash_algorithm", "model", "model_identity", "tokenizer",
                   "max_model_len")  # fmt: skip
WAIT_POLL_S = 0.5


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica's answer to ``GET /pagedkv/info``; ``url`` is where the router reached it.
    ``kv_events``: ``{"url", "stream"}`` or None (the replica publishes no events)."""

    url: str
    instance_id: str
    model: str
    model_identity: str | None
    page_format: dict[str, Any]
    allocator: str
    block_size: int
    prefix_caching: bool
    hash_algorithm: str
    max_model_len: int
    kv_events: dict[str, str] | None
    tokenizer: str | None = None  # ``Tokenizer.fingerprint()`` (None: a replica without one)

    @classmethod
    def from_json(cls, url: str, data: Any) -> ReplicaInfo:
        """``ValueError`` naming the replica for an answer that is not a replica's info."""
        try:
            events = data.get("kv_events")
            if events is not None:
                events = {"url": str(events["url"]), "stream": str(events["stream"])}
            return cls(url=url, instance_id=str(data["instance_id"]), model=str(data["model"]),
                       model_identity=data.get("model_identity"),
                       page_format=dict(data["page_format"]), allocator=str(data["allocator"]),
                       block_size=int(data["block_size"]),
                       prefix_caching=bool(data["prefix_caching"]),
                       hash_algorithm=str(data["hash_algorithm"]),
                       max_model_len=int(data["max_model_len"]), kv_events=events,
                       tokenizer=data.get("tokenizer"))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            # OverflowError: int(1e400), which JSON allows and no replica of ours sends
            raise ValueError(f"{url}{INFO_PATH} is not a pagedkv replica's info: {exc!r}") from None


def first_difference(new: ReplicaInfo, ref: ReplicaInfo) -> str | None:
    """``"block_size 32 (http://b) vs 16 (http://a)"`` for the first field in which ``new``
    differs from ``ref``; None when they may share a router."""
    pairs = [(name, getattr(new, name), getattr(ref, name)) for name in COMPARED_FIELDS]
    diffs = format_differences(new.page_format, ref.page_format)
    pairs += [(f"page_format.{k}", mine, theirs) for k, mine, theirs in diffs]
    for name, mine, theirs in pairs:
        if mine != theirs:
            return f"{name} {mine} ({new.url}) vs {theirs} ({ref.url})"
    return None


def check_compatible(infos: Sequence[ReplicaInfo]) -> None:
    """``UsageError`` (one line) for the first replica that differs from the first one."""
    for info in infos[1:]:
        diff = first_difference(info, infos[0])
        if diff is not None:
            raise UsageError(f"replicas differ and cannot share one router: {diff}", "replica")


def fetch_info(client: httpx.Client, url: str) -> ReplicaInfo:
    """``httpx.HTTPError`` when unreachable; ``ValueError`` for a wrong answer."""
    resp = client.get(url + INFO_PATH)
    if resp.status_code != 200:
        raise ValueError(f"{url}{INFO_PATH} answered {resp.status_code} (is it a pagedkv serve "
                         f"replica of this version?)")  # fmt: skip
    return ReplicaInfo.from_json(url, resp.json())


def fetch_all_infos(
    urls: Sequence[str], wait_s: float, api_key: str | None = None
) -> list[ReplicaInfo]:
    """Every replica's info, waiting up to ``wait_s`` for those not answering yet; a replica
    still unreachable (or answering wrongly) then is a ``UsageError`` naming it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    deadline = time.monotonic() + wait_s
    found: dict[str, ReplicaInfo] = {}
    with httpx.Client(timeout=5.0, headers=headers) as client:
        while True:
            problems: dict[str, str] = {}
            for url in urls:
                if url in found:
                    continue
                try:
                    found[url] = fetch_info(client, url)
                except (httpx.HTTPError, ValueError) as exc:
                    problems[url] = str(exc) or type(exc).__name__
            if not problems:
                return [found[u] for u in urls]
            if time.monotonic() >= deadline:
                url, why = next(iter(problems.items()))
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise UsageError(f"replica {url} does not answer {INFO_PATH}: {why}{more}; "
                                 "start it first or give --wait SECONDS", "replica")  # fmt: skip
            time.sleep(WAIT_POLL_S)
