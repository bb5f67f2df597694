"""P/D as a Serve graph: a prefill deployment and a decode deployment (the ingress talks to the
decode side), KV through the shared store exactly as ``pagedkv serve --role prefill|decode``.

* The prefill replicas are ``EngineReplica``s whose engines write every full block through to
  the store and answer once it is there (``flush_store``, as ``--role prefill``).
* Each decode replica, once its engine is built, asks a prefill replica for its
  ``/pagedkv/info`` through the deployment handle and checks the page-format contract with
  ``disagg.handshake.check_peer`` (the very check of ``--role decode``; ``relayout`` bridges
  the block size). A mismatch raises in the constructor: the application fails to deploy,
  before any request (``serve --replicas`` exits 2 with the mismatch line).
* The decode side's ``PDFront`` and ``PrefillClient`` are ``disagg``'s own, their breaker and
  counters included; only the transport differs: ``HandleTransport`` plays the client's HTTP
  call against the prefill deployment (routed by ``PagedKVRequestRouter``) instead of a URL.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from pagedkv.serve_ray.call import AnswerHead, ReplicaCall

PREFILL_DEPLOYMENT = "PagedKVPrefill"
# The prefill client's base URL: a name for logs and metrics; no request leaves through it.
PREFILL_URL = f"http://{PREFILL_DEPLOYMENT.lower()}.serve"


class HandleTransport(httpx.AsyncBaseTransport):
    """httpx requests answered by a Serve deployment of ``EngineReplica`` (its ``call``). The
    client's read timeout bounds the whole call; a replica that dies is a ``ConnectError``
    (the prefill client computes the prompt locally, counted ``unreachable``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = tuple((k.lower(), v) for k, v in request.headers.raw)
        call = ReplicaCall(request.method, request.url.path, request.url.query, headers, body)
        timeout_s = (request.extensions.get("timeout") or {}).get("read")
        answer = self.handle.options(stream=True).call.remote(call)
        try:
            items = await asyncio.wait_for(_all(answer), timeout_s)
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout(f"no answer within {timeout_s} s", request=request) from None
        except Exception as exc:  # noqa: BLE001 - the deployment failed the call
            raise httpx.ConnectError(
                f"{type(exc).__name__}: {exc}"[:300], request=request
            ) from None
        head = items[0]
        if not isinstance(head, AnswerHead):
            raise httpx.RemoteProtocolError("an answer without a head", request=request)
        return httpx.Response(
            head.status,
            headers=list(head.headers),
            content=b"".join(c for c in items[1:] if isinstance(c, bytes)),
            request=request,
        )


async def _all(answer: Any) -> list[Any]:
    try:
        return [item async for item in answer]
    finally:
        answer.cancel()


@dataclass(frozen=True)
class PDRole:
    """One side of the graph: ``config`` is ``disagg``'s ``PDConfig`` (role, kv_import,
    group, timeouts, breaker; ``kv_store`` is the engines')."""

    config: Any

    @property
    def is_prefill(self) -> bool:
        return self.config.role == "prefill"

    async def front(self, engine: Any, server_config: Any, prefill: Any) -> Any:
        """The decode side's ``PDFront`` once the contract holds (``UsageError`` otherwise);
        None on the prefill side."""
        if self.is_prefill:
            return None
        from pagedkv.disagg.handshake import PeerRecord, check_peer, own_record
        from pagedkv.disagg.prefill_client import prefill_client
        from pagedkv.pages.page_format import PageFormat
        from pagedkv.server.pd_front import PDFront

        info = await prefill.info.remote()
        peer = PeerRecord(
            "prefill",
            info.get("model_identity") or "",
            PageFormat.from_dict(dict(info["page_format"])),
            0,
            str(info.get("replica", "")),
        )
        model = engine.parts.model_identity
        ours = own_record("decode", model, engine.parts.page_format)
        check_peer(ours, peer, self.config.kv_import, self.config.group)
        importer = None
        if peer.page_format.block_size != engine.parts.page_format.block_size:
            from pagedkv.disagg.relayout import RelayoutImporter

            importer = RelayoutImporter.for_engine(engine, peer, self.config.kv_store, model)
        client = prefill_client(self.config, server_config.api_key, HandleTransport(prefill))
        return PDFront(client, importer)
