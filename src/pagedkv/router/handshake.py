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

from pagedkv import untrusted as u
from pagedkv.errors import UsageError
from pagedkv.pages.page_format import format_differences

INFO_PATH = "/pagedkv/info"
# The replica's own facts beyond the page format (whose fields and comparison
# ``pages/page_format.py`` owns), checked first and in this order, so the message names the most
# telling difference first.
COMPARED_FIELDS = (
    "block_size",
    "hash_algorithm",
    "model",
    "model_identity",
    "tokenizer",
    "max_model_len",
)
WAIT_POLL_S = 0.5
# Bounds on a replica's answer (a peer's bytes are untrusted input): ours is ~1 KB.
MAX_INFO_BYTES = 1 << 20
MAX_NAME_CHARS = 1024  # ids, model names, fingerprints, stream names
MAX_URL_CHARS = 2048
MAX_BLOCK_SIZE = 1 << 20  # tokens
MAX_PAGE_FIELDS = 64


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
    # Where the replica's model runs (shown, never compared: a CPU and a GPU replica of one
    # model compute the same KV); None: a replica that does not say.
    device: str | None = None
    dtype: str | None = None

    @classmethod
    def from_json(cls, url: str, data: Any) -> ReplicaInfo:
        """``data``: the parsed answer (``parse_info`` parses a body with limits). An
        ``UntrustedInput`` (a ``ValueError``) naming the replica and the field for an answer
        that is not a replica's info: every field is type- and range-checked."""
        try:
            d = u.as_object(data, "the answer")
            ev = d.get("kv_events")
            if ev is not None:
                ev = u.as_object(ev, "kv_events")
                ev = {
                    "url": u.get_str(ev, "url", max_len=MAX_URL_CHARS, at="kv_events"),
                    "stream": u.get_str(ev, "stream", max_len=MAX_NAME_CHARS, at="kv_events"),
                }
            return cls(
                url=url,
                instance_id=u.get_str(d, "instance_id", max_len=MAX_NAME_CHARS),
                model=u.get_str(d, "model", max_len=MAX_NAME_CHARS),
                model_identity=u.get_optional_str(d, "model_identity", max_len=MAX_NAME_CHARS),
                page_format=_page_format(u.get_object(d, "page_format")),
                allocator=u.get_str(d, "allocator", max_len=MAX_NAME_CHARS),
                block_size=u.get_int(d, "block_size", lo=1, hi=MAX_BLOCK_SIZE),
                prefix_caching=u.get_bool(d, "prefix_caching"),
                hash_algorithm=u.get_str(d, "hash_algorithm", max_len=MAX_NAME_CHARS),
                max_model_len=u.get_int(d, "max_model_len", lo=1, hi=1 << 40),
                kv_events=ev,
                tokenizer=u.get_optional_str(d, "tokenizer", max_len=MAX_NAME_CHARS),
                device=u.get_optional_str(d, "device", max_len=MAX_NAME_CHARS),
                dtype=u.get_optional_str(d, "dtype", max_len=MAX_NAME_CHARS),
            )
        except u.UntrustedInput as exc:
            raise u.UntrustedInput(
                f"{url}{INFO_PATH} is not a pagedkv replica's info: {exc}", exc.kind
            ) from None


def _page_format(d: dict[str, Any]) -> dict[str, Any]:
    """A page format as a replica sent it (compared, never used): at most ``MAX_PAGE_FIELDS``
    fields, each a bounded string, an integer in range, a bool or null."""
    if len(d) > MAX_PAGE_FIELDS:
        raise u.UntrustedInput(f"page_format has {len(d)} fields, over {MAX_PAGE_FIELDS}")
    for key, value in d.items():
        name = f"page_format.{key[:40]}"
        u.as_str(key, "a page_format field name", max_len=MAX_NAME_CHARS)
        if isinstance(value, str):
            u.as_str(value, name, max_len=MAX_NAME_CHARS)
        elif value is not None and not isinstance(value, bool):
            u.as_int(value, name, lo=-(1 << 40), hi=1 << 40)
    return dict(d)


def parse_info(url: str, body: bytes) -> ReplicaInfo:
    """The ``ReplicaInfo`` of a ``GET /pagedkv/info`` body, parsed with limits (size, depth,
    finite numbers); ``UntrustedInput`` (a ``ValueError``) naming the replica otherwise."""
    try:
        data = u.parse_json(body, max_bytes=MAX_INFO_BYTES, what="the answer")
    except u.UntrustedInput as exc:
        raise u.UntrustedInput(
            f"{url}{INFO_PATH} is not a pagedkv replica's info: {exc}", exc.kind
        ) from None
    return ReplicaInfo.from_json(url, data)


def first_difference(new: ReplicaInfo, ref: ReplicaInfo) -> str | None:
    """``"block_size 32 (http://b) vs 16 (http://a)"`` for the first field in which ``new``
    differs from ``ref``; None when they may share a router."""
    pairs = [(name, getattr(new, name), getattr(ref, name)) for name in COMPARED_FIELDS]
    # Across ranks: replicas of one model at different tensor-parallel sizes compute the same
    # KV for the same hashes (each speaks for all its ranks); the router's index holds.
    diffs = format_differences(new.page_format, ref.page_format, across_ranks=True)
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
    with client.stream("GET", url + INFO_PATH) as resp:
        if resp.status_code != 200:
            raise ValueError(
                f"{url}{INFO_PATH} answered {resp.status_code} (is it a pagedkv "
                "serve replica of this version?)"
            )
        body = bytearray()
        for chunk in resp.iter_bytes():
            body += chunk
            if len(body) > MAX_INFO_BYTES:  # refused by parse_info without reading the rest
                break
    return parse_info(url, bytes(body))


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
                raise UsageError(
                    f"replica {url} does not answer {INFO_PATH}: {why}{more}; "
                    "start it first or give --wait SECONDS",
                    "replica",
                )
            time.sleep(WAIT_POLL_S)
