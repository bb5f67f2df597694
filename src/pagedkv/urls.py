"""The one rule for a peer's HTTP base URL given on the command line (``route --replica``,
``serve --prefill-url``): checked once at the edge, so a bad URL is a one-line error at
start-up instead of a traceback, or a failure of every request later.

``redis://`` URLs have their own rule, next to the store (``kvstore/address.py``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pagedkv.errors import UsageError

HTTP_SCHEMES = ("http", "https")


def http_base_url(url: str, flag: str) -> str:
    """``http(s)://HOST[:PORT]`` with any trailing ``/`` and ``/v1`` removed (callers append
    the routes). HOST is a name or an address, IPv6 in brackets (``http://[::1]:8000``);
    PORT, when given, is in 1..65535. Anything else (another scheme, no host, a port out of
    range or not a number, credentials, a path, a query, unbalanced brackets) is a one-line
    ``UsageError`` naming ``flag`` (e.g. ``"--replica"``; ``param`` is the flag without
    dashes, underscored)."""
    param = flag.lstrip("-").replace("-", "_")
    shape = f"{flag} {url!r} is not an http(s)://HOST:PORT URL"
    if not isinstance(url, str) or any(c.isspace() or ord(c) < 32 for c in url.strip()):
        raise UsageError(shape, param)
    text = url.strip().rstrip("/")
    if text.endswith("/v1"):
        text = text[: -len("/v1")]
    try:
        parts = urlsplit(text)
        port = parts.port  # ValueError: not a number, or out of 0..65535
    except ValueError as exc:  # also: "Invalid IPv6 URL" (an unclosed '[')
        raise UsageError(f"{shape}: {exc}", param) from None
    if parts.scheme not in HTTP_SCHEMES or not parts.hostname:
        raise UsageError(shape, param)
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"{shape}: the port must be in 1..65535, got {port}", param)
    if parts.netloc.endswith(":"):
        raise UsageError(f"{shape}: a ':' without a port", param)
    if parts.username is not None or parts.password is not None:
        raise UsageError(f"{shape}: credentials in the URL are not supported", param)
    if parts.path or parts.query or parts.fragment:
        raise UsageError(f"{flag} {url!r}: give the base URL only (no path)", param)
    return text
