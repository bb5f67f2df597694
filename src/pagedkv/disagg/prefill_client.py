"""The decode side's call to its prefill instance: compute these prompts, keep their KV.

The prefill instance serves the ordinary OpenAI completions route; asking it for one greedy
token of each prompt makes it run the whole prompt, and its store tier writes every full
block to the shared store on the way. The decode side then admits the request itself and
loads those blocks. If the prefill instance fails, is slow or cannot be reached, the decode
side computes the prompt itself (a *local prefill*): slower, never wrong, and counted by
reason. A circuit breaker (``pagedkv.breaker``) stops a sick prefill instance from costing
every request its timeout: after ``failure_threshold`` consecutive failures no request asks
it until the back-off has passed, then one request probes it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import httpx

from pagedkv.breaker import CircuitBreaker
from pagedkv.disagg.config import PDConfig

log = logging.getLogger("pagedkv.disagg")

# Why a prompt was computed here instead (the ``reason`` label of the local-prefill counter).
BREAKER_OPEN = "breaker_open"  # not sent: the prefill instance failed too often lately
TIMEOUT = "timeout"  # no answer within --prefill-timeout (a stopped or overloaded instance)
UNREACHABLE = "unreachable"  # refused or failed connection: fails at once
ERROR = "error"  # an answer other than 200, or any other failure of the call
LOCAL_PREFILL_REASONS = (BREAKER_OPEN, TIMEOUT, UNREACHABLE, ERROR)
# A connection that is not made within this is a dead host, whatever --prefill-timeout says
# (that one is for a prefill that takes long).
MAX_CONNECT_TIMEOUT_S = 5.0


class PrefillClient:
    """One ``httpx.AsyncClient`` to the prefill instance; ``prefill`` never raises for the
    prefill side's failures (it returns False and counts them). Counters: ``num_requests``
    (calls sent), ``num_failures`` (sent calls that failed), ``prompt_tokens`` (computed
    there), ``local_prefills`` (reason -> requests computed here, ``LOCAL_PREFILL_REASONS``).
    ``breaker``: the circuit breaker in front of it (default: 3 failures, 5 s back-off).
    ``transport``: for tests (an ``httpx.MockTransport``)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        api_key: str | None = None,
        breaker: CircuitBreaker | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, MAX_CONNECT_TIMEOUT_S))
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout, headers=headers, transport=transport
        )
        self._base_url = base_url
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self._logged_failure = False
        self.num_requests = 0
        self.num_failures = 0
        self.prompt_tokens = 0
        self.local_prefills: Counter[str] = Counter({r: 0 for r in LOCAL_PREFILL_REASONS})

    async def prefill(self, prompts: Sequence[Sequence[int]], cache_salt: str | None) -> bool:
        """Have the prefill instance compute ``prompts`` (token ids) under ``cache_salt``
        (the same salt keys the same blocks on both sides). True when it answered 200; False
        when the caller must compute the prompts itself (counted in ``local_prefills``),
        without asking the prefill instance at all while the breaker is open."""
        if not self.breaker.allow():
            self.local_prefills[BREAKER_OPEN] += 1
            return False
        self.num_requests += 1
        body: dict = {
            "prompt": [list(p) for p in prompts],
            "max_tokens": 1,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        try:
            # Only the status matters: the body (a peer's bytes, unbounded) is never read.
            async with self._client.stream("POST", "/v1/completions", json=body) as resp:
                ok = resp.status_code == 200
            kind, reason = ERROR, f"HTTP {resp.status_code}"
        except httpx.TimeoutException as exc:
            ok, kind, reason = False, TIMEOUT, f"{type(exc).__name__}: {exc}"
        except (httpx.ConnectError, OSError) as exc:  # refused, no route, name unknown
            ok, kind, reason = False, UNREACHABLE, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any failure of the call means: compute here
            # (an ExceptionGroup from the connect of a URL httpx could not use was a 500 once)
            ok, kind, reason = False, ERROR, f"{type(exc).__name__}: {exc}"
        except BaseException:  # cancelled (the client left): no verdict on the prefill side
            self.breaker.release()
            raise
        if ok:
            self.breaker.record_success()
            self.prompt_tokens += sum(len(p) for p in prompts)
            if self._logged_failure:
                log.warning("prefill instance %s answers again", self._base_url)
                self._logged_failure = False
            return True
        self.breaker.record_failure()
        self.num_failures += 1
        self.local_prefills[kind] += 1
        if not self._logged_failure:  # once per outage, not once per request
            log.warning(
                "prefill instance %s failed (%s); computing prompts here until it answers again",
                self._base_url,
                reason[:200],
            )
            self._logged_failure = True
        return False

    async def aclose(self) -> None:
        await self._client.aclose()


def prefill_client(
    cfg: PDConfig, api_key: str | None, transport: httpx.AsyncBaseTransport | None = None
) -> PrefillClient:
    """The decode side's client as ``cfg`` configures it (``cfg.role`` is ``decode``).
    ``transport``: where its HTTP calls go instead of the network (a Serve deployment's
    handle on Ray, ``serve_ray/pd.py``)."""
    assert cfg.prefill_url is not None
    breaker = CircuitBreaker(
        failure_threshold=cfg.breaker_failures,
        backoff_s=cfg.breaker_backoff_s,
        max_backoff_s=cfg.breaker_max_backoff_s,
        # A safety net only (every call reports its outcome): a probe silent for longer than
        # any call can take is presumed lost.
        probe_timeout_s=2 * cfg.prefill_timeout_s + MAX_CONNECT_TIMEOUT_S,
    )
    return PrefillClient(cfg.prefill_url, cfg.prefill_timeout_s, api_key, breaker, transport)
