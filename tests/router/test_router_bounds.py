"""Issue 27's "unbounded buffers in the router": a replica's event that never ends, a huge
non-streaming answer, and a replica that goes on streaming after the client left. A hostile
fake replica (in-process, ``httpx.MockTransport``) counts every byte the router pulls from it;
each test bounds that count, so a router that buffers without limit or keeps reading fails
(it would pull forever: the test's client times out, or the count passes its bound)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from pagedkv.router.app import create_router_app
from pagedkv.router.config import RouterConfig
from pagedkv.router.handshake import ReplicaInfo
from pagedkv.router.server import load_tokenizer
from tests.router.fakes import FakeReader, info_json, serving

URL = "http://10.0.0.1:8000"
MAX_EVENT_BYTES = 256 << 10
MAX_ANSWER_BYTES = 1 << 20
CHUNK = b"x" * 4096  # of an event that never ends
TOKEN_EVENT = b'data: {"choices":[{"text":"t"}]}\n\n'
GENEROUS_S = 30.0


class Hostile:
    """One replica whose generation answers follow ``mode``: ``endless_event`` (bytes without
    the blank line), ``huge_event`` (two events, then one that never ends), ``huge_body``
    (a non-streaming answer that never ends), ``forever`` (events forever), ``silent`` (a
    stream that sends nothing). ``pulled`` counts the bytes the router has read."""

    def __init__(self) -> None:
        self.mode, self.pulled, self.started = "ok", 0, threading.Event()
        self.closed = False  # the router closed the answer's stream (or cancelled the read)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/pagedkv/info":
            return httpx.Response(200, json=info_json("one"))
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/metrics":
            return httpx.Response(200, text="pagedkv_requests_in_flight 0.0\n")
        stream = json.loads(request.content).get("stream", False)
        kind = "text/event-stream" if stream else "application/json"
        return httpx.Response(200, headers={"content-type": kind}, content=self._body())

    async def _body(self):
        self.started.set()
        try:
            if self.mode == "silent":
                await asyncio.sleep(3600)
            if self.mode == "huge_event":
                for _ in range(2):
                    yield self._count(TOKEN_EVENT)
            while True:
                await asyncio.sleep(0)  # as a socket would: the router's loop runs between reads
                yield self._count(TOKEN_EVENT if self.mode == "forever" else CHUNK)
        finally:
            self.closed = True

    def _count(self, chunk: bytes) -> bytes:
        self.pulled += len(chunk)
        return chunk


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture
def router(tokenizer):
    """``(url, hostile replica, app)`` of a router with small caps over one hostile replica."""
    peer = Hostile()
    config = RouterConfig((URL,), policy="round-robin", health_interval_s=0.1,
                          request_timeout_s=GENEROUS_S, max_event_bytes=MAX_EVENT_BYTES,
                          max_answer_bytes=MAX_ANSWER_BYTES)  # fmt: skip
    app = create_router_app(config, [ReplicaInfo.from_json(URL, info_json("one"))], tokenizer,
                            reader_factory=FakeReader,
                            transport=httpx.MockTransport(peer.handle))  # fmt: skip
    with serving(app) as url:
        yield url, peer, app


def _body(stream: bool) -> dict:
    return {"prompt": "tell me", "max_tokens": 4, "stream": stream}


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + GENEROUS_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _released(app) -> bool:
    return all(r.in_flight == 0 for r in app.state.replicas)


def _outcome_count(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagedkv_router_requests_total{")
               and f'outcome="{outcome}"' in line)  # fmt: skip


def test_an_event_that_never_ends_is_a_502_after_the_cap(router):
    url, peer, app = router
    peer.mode = "endless_event"
    resp = httpx.post(f"{url}/v1/completions", json=_body(True), timeout=GENEROUS_S)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "replica_answer_too_large" and error["type"] == "server_error"
    assert f"more than {MAX_EVENT_BYTES} bytes" in error["message"] and URL in error["message"]
    assert peer.pulled <= MAX_EVENT_BYTES + len(CHUNK)  # the cap, plus the chunk that passed it
    _wait(lambda: _released(app), "the replica's in-flight count to be released")
    assert app.state.replicas[0].routable  # it answered: not taken out


def test_an_event_over_the_cap_mid_stream_ends_it_with_an_error_event(router):
    url, peer, app = router
    peer.mode = "huge_event"
    with httpx.stream("POST", f"{url}/v1/completions", json=_body(True),
                      timeout=GENEROUS_S) as resp:  # fmt: skip
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[:2] == [TOKEN_EVENT.decode().strip()] * 2
    error = json.loads(lines[2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_answer_too_large"  # the shape of a replica_failed event
    assert f"more than {MAX_EVENT_BYTES} bytes" in error["message"]
    assert lines[3:] == ["data: [DONE]"]
    assert peer.pulled <= 2 * len(TOKEN_EVENT) + MAX_EVENT_BYTES + len(CHUNK)
    _wait(lambda: _outcome_count(url, "failed") == 1, "the stream to be counted failed")
    assert _released(app) and app.state.replicas[0].routable


def test_a_non_streaming_answer_over_the_cap_is_a_502(router):
    url, peer, app = router
    peer.mode = "huge_body"
    resp = httpx.post(f"{url}/v1/completions", json=_body(False), timeout=GENEROUS_S)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "replica_answer_too_large"
    assert f"an answer of more than {MAX_ANSWER_BYTES} bytes" in error["message"]
    assert peer.pulled <= MAX_ANSWER_BYTES + len(CHUNK)
    _wait(lambda: _outcome_count(url, "failed") == 1, "the request to be counted failed")
    assert _released(app)


def test_a_client_leaving_a_stream_stops_the_reading_at_once(router):
    url, peer, app = router
    peer.mode = "forever"
    with httpx.stream("POST", f"{url}/v1/completions", json=_body(True),
                      timeout=GENEROUS_S) as resp:  # fmt: skip
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        pulled_when_left = peer.pulled
    _wait(lambda: _outcome_count(url, "aborted") == 1, "the stream to be counted aborted")
    _wait(lambda: _released(app), "the replica's in-flight count to be released")
    after = peer.pulled - pulled_when_left
    # Bounded: what was in flight when the disconnect was seen (a forever stream otherwise).
    assert after < 1 << 20, after
    httpx.get(f"{url}/metrics", timeout=10)  # one more turn of the router's loop
    assert peer.pulled - pulled_when_left == after  # and nothing since


def test_a_client_leaving_before_the_first_event_closes_the_replica_answer(router):
    url, peer, app = router
    peer.mode = "silent"
    # The status line waits for the first event, which never comes: send, then leave.
    body = json.dumps(_body(True)).encode()
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=GENEROUS_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        assert peer.started.wait(GENEROUS_S), "the request did not reach the replica"
    # The router sees the disconnect while it awaits the first event, and cancels the read.
    _wait(lambda: peer.closed, "the router to close the replica's answer")
    _wait(lambda: _outcome_count(url, "aborted") == 1, "the request to be counted aborted")
    assert _released(app)
