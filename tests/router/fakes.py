"""In-process fake replicas (an ``httpx.MockTransport``) and a fake KV event reader, for the
router's retry, stream-error and 503 logic without engines. A fake replica answers
``/pagedkv/info``, ``/health``, ``/metrics`` and both generation routes; ``mode`` makes it
fail: ``down`` (connection refused), ``reset`` (closes before answering), ``503``, ``cut``
(a stream breaks after ``CUT_AFTER_EVENTS`` events), ``slow`` (a second between events),
``timeout`` (every generation request times out, as on a SIGSTOPped replica)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from pagedkv.router.handshake import ReplicaInfo
from pagedkv.server.uvicorn_server import bind, url_of

PAGE_FORMAT = {"block_size": 16, "attention": "mha", "kv_dtype": "fp32", "num_layers": 30,
               "num_kv_heads": 3, "head_dim": 64, "kv_lora_rank": 0, "qk_rope_head_dim": 0,
               "record_bytes": 46080}  # fmt: skip
NUM_STREAM_EVENTS = 4
CUT_AFTER_EVENTS = 2


def info_json(instance_id: str, block_size: int = 16) -> dict:
    return {"instance_id": instance_id, "model": "SmolLM2-135M-Instruct", "model_identity": "m",
            "page_format": {**PAGE_FORMAT, "block_size": block_size}, "allocator": "paged",
            "block_size": block_size, "prefix_caching": True, "hash_algorithm": "sha256",
            "max_model_len": 2048, "device": "cuda:0", "dtype": "bfloat16",
            "kv_events": {"url": "redis://fake:1", "stream": f"s-{instance_id}"}}  # fmt: skip


class FakeReplica:
    def __init__(self, url: str) -> None:
        self.url, self.mode, self.block_size = url, "ok", 16
        self.instance_id = url.split("//")[1].replace(".", "").replace(":", "")
        self.bodies: list[dict] = []
        self.probes_ok = False  # True: probes answer whatever ``mode`` says (no health race)

    def info(self) -> ReplicaInfo:
        return ReplicaInfo.from_json(self.url, info_json(self.instance_id, self.block_size))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.mode == "down" and not (self.probes_ok and not path.startswith("/v1/")):
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/pagedkv/info":
            return httpx.Response(200, json=info_json(self.instance_id, self.block_size))
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/metrics":
            return httpx.Response(200, text="pagedkv_requests_in_flight 0.0\n")
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.mode == "reset":
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        if self.mode == "timeout":  # a stopped process: the read times out (no real waiting)
            raise httpx.ReadTimeout("timed out", request=request)
        if self.mode == "503":
            err = {"error": {"message": "the engine is not running", "type": "server_error"}}
            return httpx.Response(503, json=err)
        if not body.get("stream"):
            return httpx.Response(200, json={"replica": self.url, "choices": [{"text": "ok"}]})
        mode = self.mode

        async def events():
            for i in range(NUM_STREAM_EVENTS):
                if mode == "cut" and i == CUT_AFTER_EVENTS:
                    raise httpx.RemoteProtocolError("peer closed connection", request=request)
                yield f'data: {{"choices":[{{"text":"t{i}"}}]}}\n\n'.encode()
                if mode == "slow":
                    await asyncio.sleep(1.0)
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=events())  # fmt: skip


class FakeFleet:
    """Replicas by URL behind one transport."""

    def __init__(self, n: int) -> None:
        self.replicas = [FakeReplica(f"http://10.0.0.{i + 1}:8000") for i in range(n)]
        self.transport = httpx.MockTransport(self._handle)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        return await next(r for r in self.replicas if r.url == url).handle(request)


class FakeReader:
    """Stands in for ``KVEventReader``; ``READERS`` keeps every one built (tests push batches
    through ``on_batch``)."""

    READERS: list[FakeReader] = []

    def __init__(self, url: str, stream: str, on_batch) -> None:
        self.url, self.stream, self.on_batch = url, stream, on_batch
        self.connected, self.num_batches, self.stopped = True, 0, False
        FakeReader.READERS.append(self)

    def start(self) -> FakeReader:
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        self.stopped = True


@contextmanager
def serving(app):
    """Run ``app`` under uvicorn on a free loopback port; yields its base URL."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.01)
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(10)
