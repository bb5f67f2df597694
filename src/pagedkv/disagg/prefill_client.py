"""The decode side's call to its prefill instance: compute these prompts, keep their KV.

The prefill instance serves the ordinary OpenAI completions route; asking it for one greedy
token of each prompt makes it run the whole prompt, and its store tier writes every full
block to the shared store on the way. The decode side then admits the request itself and
loads those blocks. If the prefill instance fails or is slow, the decode side computes the
prompt itself: slower, never wrong, and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import httpx

log = logging.getLogger("pagedkv.disagg")


class PrefillClient:
    """One ``httpx.AsyncClient`` to the prefill instance; ``prefill`` never raises for the
    prefill side's failures (it returns False and counts them). Counters: ``num_requests``,
    ``num_failures``, ``prompt_tokens``."""

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                         headers=headers)  # fmt: skip
        self._base_url = base_url
        self._logged_failure = False
        self.num_requests = 0
        self.num_failures = 0
        self.prompt_tokens = 0

    async def prefill(self, prompts: Sequence[Sequence[int]], cache_salt: str | None) -> bool:
        """Have the prefill instance compute ``prompts`` (token ids) under ``cache_salt``
        (the same salt keys the same blocks on both sides). True when it answered 200."""
        self.num_requests += 1
        body: dict = {"prompt": [list(p) for p in prompts], "max_tokens": 1,
                      "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        try:
            resp = await self._client.post("/v1/completions", json=body)
            ok = resp.status_code == 200
            reason = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if ok:
            self.prompt_tokens += sum(len(p) for p in prompts)
            if self._logged_failure:
                log.warning("prefill instance %s answers again", self._base_url)
                self._logged_failure = False
            return True
        self.num_failures += 1
        if not self._logged_failure:  # once per outage, not once per request
            log.warning("prefill instance %s failed (%s); computing prompts here until it "
                        "answers again", self._base_url, reason)  # fmt: skip
            self._logged_failure = True
        return False

    async def aclose(self) -> None:
        await self._client.aclose()
