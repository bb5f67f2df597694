"""The decode instance's front of a prefill/decode pair (``pagedkv serve --role decode``).

Before a request is admitted, its prompts go to the prefill instance (``PrefillClient``),
whose store tier writes their full blocks to the shared store; with ``--kv-import relayout``
the blocks are then re-paged into this instance's block size (``disagg.relayout``). The engine
then admits the request as usual and its store tier finds the prompt's blocks. Nothing here is
needed for correctness: if the prefill instance or the import fails, the engine computes the
prompt itself (counted in ``/metrics`` by reason, with the prefill client's circuit breaker).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.breaker import STATES, BreakerCounts
from pagedkv.disagg.prefill_client import PrefillClient

log = logging.getLogger("pagedkv.disagg")


class PDFront:
    """``before_admit`` is awaited by the generation routes; ``importer`` (optional) has
    ``import_prompts(prompts, cache_salt) -> int`` (blocks written) and counters, and runs on
    a worker thread (it blocks on the store)."""

    def __init__(self, prefill: PrefillClient, importer=None) -> None:
        self.prefill = prefill
        self.importer = importer
        self.num_import_failures = 0

    async def before_admit(self, prompts: Sequence[Sequence[int]], cache_salt: str | None) -> None:
        """Never raises for the pair's failures: the request then computes its prompt here."""
        if await self.prefill.prefill(prompts, cache_salt) and self.importer is not None:
            try:
                await asyncio.to_thread(self.importer.import_prompts, prompts, cache_salt)
            except Exception:  # noqa: BLE001 - a bug in the import must not fail the request
                self.num_import_failures += 1
                if self.num_import_failures == 1:
                    log.exception("relayout import failed; prompts are computed here instead")

    async def aclose(self) -> None:
        await self.prefill.aclose()

    def collector(self) -> Collector:
        return _PDCollector(self)


class _PDCollector(Collector):
    def __init__(self, front: PDFront) -> None:
        self._front = front

    def collect(self) -> Iterator[Metric]:
        yield from _prefill_metrics(self._front.prefill)
        yield from _breaker_metrics(self._front.prefill.breaker.counts())
        if self._front.importer is not None:
            yield from _relayout_metrics(self._front)


def _prefill_metrics(p: PrefillClient) -> Iterator[Metric]:
    """The prefill calls: sent, failed, their prompt tokens, prompts computed here by reason."""
    yield CounterMetricFamily(
        "pagedkv_pd_prefill_requests",
        "requests sent to the prefill instance",
        value=p.num_requests,
    )
    yield CounterMetricFamily(
        "pagedkv_pd_prefill_failures",
        "prefill calls that failed (the prompt was computed here instead)",
        value=p.num_failures,
    )
    yield CounterMetricFamily(
        "pagedkv_pd_prefill_prompt_tokens",
        "prompt tokens the prefill instance computed",
        value=p.prompt_tokens,
    )
    local = CounterMetricFamily(
        "pagedkv_pd_local_prefills",
        "requests whose prompt was computed here instead of by the prefill instance, by reason",
        labels=["reason"],
    )
    for reason, count in sorted(p.local_prefills.items()):
        local.add_metric([reason], count)
    yield local


def _breaker_metrics(b: BreakerCounts) -> Iterator[Metric]:
    """The prefill client's circuit breaker: its state, opens, probes, short circuits, back-off."""
    state = GaugeMetricFamily(
        "pagedkv_pd_prefill_breaker_state",
        "the prefill client's circuit breaker: 1 for its state",
        labels=["state"],
    )
    for name in STATES:
        state.add_metric([name], 1.0 if b.state == name else 0.0)
    yield state
    yield CounterMetricFamily(
        "pagedkv_pd_prefill_breaker_opens",
        "times the breaker opened (prefill calls stopped)",
        value=b.num_opens,
    )
    yield CounterMetricFamily(
        "pagedkv_pd_prefill_breaker_probes",
        "calls let through to probe an open breaker's peer",
        value=b.num_probes,
    )
    yield CounterMetricFamily(
        "pagedkv_pd_prefill_breaker_short_circuits",
        "requests not sent to the prefill instance (breaker open)",
        value=b.num_short_circuits,
    )
    yield GaugeMetricFamily(
        "pagedkv_pd_prefill_breaker_backoff_seconds",
        "the breaker's current (or next) open period",
        value=b.backoff_s,
    )


def _relayout_metrics(front: PDFront) -> Iterator[Metric]:
    """The relayout import's blocks, failures and misses (a front with an importer)."""
    imp = front.importer
    yield CounterMetricFamily(
        "pagedkv_pd_relayout_blocks",
        "blocks re-paged into this block size on import",
        value=imp.num_blocks_written,
    )
    yield CounterMetricFamily(
        "pagedkv_pd_relayout_failures",
        "relayout imports that failed (computed here instead)",
        value=front.num_import_failures,
    )
    yield CounterMetricFamily(
        "pagedkv_pd_relayout_misses",
        "prompt blocks the prefill side's store did not hold",
        value=imp.num_source_misses,
    )
