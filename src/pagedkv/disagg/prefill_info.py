"""What the prefill instance says about itself *now*: its ``GET /pagedkv/info``, over HTTP.

The store's handshake record (``handshake.py``) may be stale: left by an instance that has
since been restarted with another ``--block-size``, or by another prefill instance of the
group. The decode side therefore also asks the instance at ``--prefill-url`` itself, and the
pairing compares the two (``handshake.check_live``). The answer is a peer's bytes: read at
most ``MAX_INFO_BYTES``, parsed by the shared ``untrusted`` reader: any shape of JSON is a
``ValueError`` naming the field, never another exception.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pagedkv.errors import UsageError
from pagedkv.pages.page_format import PAGE_FORMAT_FIELDS
from pagedkv.untrusted import (
    UntrustedInput,
    as_int,
    as_object,
    as_str,
    get_object,
    get_optional_str,
    parse_json,
)

INFO_PATH = "/pagedkv/info"
MAX_INFO_BYTES = 256 * 1024  # a real answer is under 1 KiB
MAX_FIELD_CHARS = 256
CALL_TIMEOUT_S = 5.0
POLL_S = 0.5


@dataclass(frozen=True)
class LiveInfo:
    """The fields of a prefill instance's info the pairing compares. ``page_format``: the
    instance's ``PageFormat.to_dict()`` as sent (every field present, ints and short strings;
    compared as a mapping, like the router does)."""

    url: str
    model_identity: str | None
    page_format: dict[str, int | str]


def parse_info(url: str, body: bytes) -> LiveInfo:
    """``ValueError`` (``untrusted.UntrustedInput``) naming ``url`` for anything but a pagedkv
    info answer: over ``MAX_INFO_BYTES``, too deep, not JSON, a page format with missing,
    extra or odd fields."""
    where = f"{url}{INFO_PATH}"
    data = as_object(parse_json(body, max_bytes=MAX_INFO_BYTES, what=where), where)
    pages = get_object(data, "page_format", at=where)
    if set(pages) != set(PAGE_FORMAT_FIELDS):
        raise UntrustedInput(
            f"{where}: page_format fields {sorted(pages)[:20]} are not {sorted(PAGE_FORMAT_FIELDS)}"
        )
    checked: dict[str, int | str] = {}
    for name, value in pages.items():
        at = f"{where}.page_format.{name}"
        checked[name] = (
            as_str(value, at, max_len=MAX_FIELD_CHARS)
            if isinstance(value, str)
            else as_int(value, at, lo=0, hi=2**63 - 1)
        )
    identity = get_optional_str(data, "model_identity", max_len=MAX_FIELD_CHARS, at=where)
    return LiveInfo(url, identity, checked)


def fetch_info(client: httpx.Client, url: str) -> LiveInfo:
    """One ``GET``: ``httpx.HTTPError`` (or ``OSError``) when unreachable, ``ValueError`` for
    a wrong answer. The body is read only up to ``MAX_INFO_BYTES`` (+1, to tell it is over)."""
    with client.stream("GET", url + INFO_PATH) as resp:
        if resp.status_code != 200:
            raise ValueError(
                f"{url}{INFO_PATH} answered HTTP {resp.status_code} (a wrong "
                "--prefill-url, another API key, or not a pagedkv serve?)"
            )
        body = bytearray()
        for chunk in resp.iter_bytes():
            body += chunk
            if len(body) > MAX_INFO_BYTES:
                break
    return parse_info(url, bytes(body))


def wait_for_info(
    url: str,
    api_key: str | None,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    transport: httpx.BaseTransport | None = None,
) -> LiveInfo:
    """The prefill instance's info, retried until ``wait_s`` has passed while it cannot be
    reached (it may still be starting); then, or at once for a wrong answer, a one-line
    ``UsageError`` naming the URL."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    deadline_s = clock() + wait_s
    with httpx.Client(timeout=CALL_TIMEOUT_S, headers=headers, transport=transport) as client:
        while True:
            try:
                return fetch_info(client, url)
            except ValueError as exc:
                raise UsageError(f"--prefill-url: {exc}", "prefill_url") from None
            except (httpx.HTTPError, OSError) as exc:
                why = f"{type(exc).__name__}: {exc}"[:200]
            if clock() >= deadline_s:
                raise UsageError(
                    f"the prefill instance at {url} does not answer {INFO_PATH} ({why}) within "
                    f"{wait_s:g} s: start it first (--pd-wait sets how long to wait), or fix "
                    "--prefill-url",
                    "prefill_url",
                )
            sleep(POLL_S)
