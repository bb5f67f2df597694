"""A bounded load test of `pagedkv serve`: many concurrent streaming clients on loopback.

Each of ``--clients`` clients sends ``--requests-per-client`` streaming chat or completion
requests one after another (the official ``openai`` async client), so up to ``--clients``
requests are in flight at once and join the running batch as they arrive. Every request must
end as completed or with an explicit error; one that hangs past ``--request-timeout-s`` or
ends without ``[DONE]`` is *lost*. After the load, ``/metrics`` must show no block in use.

Reports requests/s, generated tokens/s, time to first token p50/p99, the peak number of
sequences in the running batch, and lost requests; exits 1 if any request was lost or a block
stayed in use. By default it starts its own server (embedded SmolLM2) on 127.0.0.1; ``--url``
targets a running one, loopback only. ``--engine-baseline`` then runs the same requests through
the engine directly (no HTTP, all queued at once), for the cost of the server around it.

    python benchmarks/load_server.py [--clients 64] [--requests-per-client 4] [--max-tokens 32]
                                     [--engine-baseline] [--json results/load_server.json]

``--giant PROMPTS`` measures fair admission instead: one streamed request of PROMPTS prompts x
n = 4, then (``--giant-delay-s`` later) one small request; it reports how long the small one
took and how many of the giant's samples had finished by then (the giant is then abandoned).
``--admit-ahead-seqs 1000000`` (server started here) is first come, first served, to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from common import finish_meta, machine_meta, write_json

TOPICS = ["the ocean", "a lighthouse", "compilers", "bread", "winter", "a violin", "trains",
          "the moon", "gardening", "chess", "volcanoes", "libraries", "bees", "rain"]  # fmt: skip
SYSTEM = "You are a helpful assistant. Answer in a few sentences."  # a prefix all requests share


def chat(k: int) -> list[dict[str, str]]:
    """The messages of request ``k`` (every request shares the system prompt)."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Tell me about {TOPICS[k % len(TOPICS)]}."}]  # fmt: skip


def engine_baseline_tokens_per_s(engine, num_requests: int, args) -> float:
    """The same requests straight through ``LLMEngine.generate`` (all queued at once, no
    HTTP): what the server's tokens/s compares with. Run after the server stopped."""
    from pagedkv.engine import SamplingParams

    prompts = [engine.tokenizer.apply_chat_template(chat(k)) for k in range(num_requests)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=k,
                             ignore_eos=True) for k in range(num_requests)]  # fmt: skip
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed


@dataclass
class Outcome:
    completed: bool
    error: str | None  # explicit error (status or error event); None if completed or lost
    ttft_s: float | None
    completion_tokens: int


@dataclass(frozen=True)
class Report:
    clients: int
    requests: int
    completed: int
    explicit_errors: int
    lost: int
    wall_s: float
    requests_per_s: float
    generated_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    peak_running_seqs: int
    kv_blocks_used_after: int
    requests_in_flight_after: int


async def one_request(client: openai.AsyncOpenAI, model: str, k: int, args) -> Outcome:
    start = time.perf_counter()
    ttft, tokens, done = None, 0, False
    try:
        messages = chat(k)
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, temperature=0.7,
            seed=k, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                tokens, done = chunk.usage.completion_tokens, True
    except openai.APIStatusError as exc:  # an explicit error status: not lost
        return Outcome(False, f"{exc.status_code}: {exc.message}", None, 0)
    except openai.APIError as exc:
        if isinstance(exc, openai.APIConnectionError | openai.APITimeoutError):
            return Outcome(False, None, ttft, tokens)  # hung or dropped: lost
        return Outcome(False, f"error event: {exc.message}", None, 0)
    # The usage chunk comes last, just before [DONE]: without it the stream was cut short.
    return Outcome(done, None, ttft, tokens)


async def run_load(base_url: str, model: str, args) -> tuple[list[Outcome], float]:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    http = httpx.AsyncClient(limits=limits, timeout=args.request_timeout_s)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=args.api_key or "none",
                                  http_client=http, max_retries=0) as client:  # fmt: skip

        async def one_client(c: int) -> list[Outcome]:
            n = args.requests_per_client
            return [await one_request(client, model, c * n + r, args) for r in range(n)]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(c) for c in range(args.clients)))
        wall_s = time.perf_counter() - t0
    return [o for outs in per_client for o in outs], wall_s


async def giant_then_small(base_url: str, model: str, args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    common = {"model": model, "max_tokens": args.max_tokens, "ignore_eos": True}
    giant = {**common, "prompt": [f"Tell me about {TOPICS[k % len(TOPICS)]} ({k})."
                                  for k in range(args.giant)], "n": 4, "stream": True}  # fmt: skip
    samples_done = [0]
    async with httpx.AsyncClient(timeout=args.request_timeout_s, headers=headers) as http:

        async def stream_giant() -> None:
            async with http.stream("POST", f"{base_url}/v1/completions", json=giant) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:]).get("choices", [])
                        samples_done[0] += sum(1 for c in choices if c.get("finish_reason"))

        task = asyncio.create_task(stream_giant())
        await asyncio.sleep(args.giant_delay_s)
        t0 = time.perf_counter()
        small = await http.post(f"{base_url}/v1/completions",
                                json={**common, "prompt": "Tell me about bees."})  # fmt: skip
        small_s, done = time.perf_counter() - t0, samples_done[0]
        task.cancel()  # closing the stream aborts what is left of the giant
        await asyncio.gather(task, return_exceptions=True)
    return {"giant_samples": args.giant * 4, "small_status": small.status_code,
            "small_latency_s": round(small_s, 2), "giant_samples_done_before_small": done,
            "admit_ahead_seqs": args.admit_ahead_seqs}  # fmt: skip


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(outcomes: list[Outcome], wall_s: float, base_url: str, args) -> Report:
    deadline = time.monotonic() + 10  # the last aborts/finishes land within a step or two
    after = scrape(base_url)
    while (after["pagedkv_kv_blocks_used"] or after["pagedkv_requests_in_flight"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
        after = scrape(base_url)
    completed = [o for o in outcomes if o.completed]
    errors = [o for o in outcomes if o.error is not None]
    ttfts = [o.ttft_s for o in completed if o.ttft_s is not None]
    tokens = sum(o.completion_tokens for o in completed)
    return Report(
        clients=args.clients,
        requests=len(outcomes),
        completed=len(completed),
        explicit_errors=len(errors),
        lost=len(outcomes) - len(completed) - len(errors),
        wall_s=round(wall_s, 2),
        requests_per_s=round(len(completed) / wall_s, 2),
        generated_tokens_per_s=round(tokens / wall_s, 1),
        ttft_p50_s=round(statistics.median(ttfts), 3) if ttfts else float("nan"),
        ttft_p99_s=round(percentile(ttfts, 0.99), 3),
        peak_running_seqs=int(after["pagedkv_sequences_running_peak"]),
        kv_blocks_used_after=int(after["pagedkv_kv_blocks_used"]),
        requests_in_flight_after=int(after["pagedkv_requests_in_flight"]),
    )


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise SystemExit(f"load_server: --url must be a loopback address, got {host!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--url", help="a running server (loopback only); default: start one here")
    ap.add_argument("--api-key", help="bearer token of --url's server")
    ap.add_argument("--model", help="model for the server started here (default: embedded)")
    ap.add_argument("--torch-threads", type=int, default=1, help="for the server started here")
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument(
        "--engine-baseline",
        action="store_true",
        help="afterwards, run the same requests through the engine directly (no HTTP)",
    )
    ap.add_argument("--giant", type=int, help="measure fair admission (see above) instead")
    ap.add_argument("--giant-delay-s", type=float, default=3.0)
    ap.add_argument("--admit-ahead-seqs", type=int, help="the fair queue's depth (server here)")
    args = ap.parse_args(argv)
    if min(args.clients, args.requests_per_client, args.max_tokens) < 1:
        raise SystemExit("load_server: counts must be >= 1")
    meta = machine_meta()
    server = engine = None
    if args.url:
        check_loopback(args.url)
        base_url = args.url.rstrip("/").removesuffix("/v1")
    else:
        import torch

        from pagedkv.engine import EngineConfig, LLMEngine
        from pagedkv.server import ServerConfig, create_app, start_in_background
        from pagedkv.server.engine_loop import ADMIT_AHEAD_SEQS

        torch.set_num_threads(args.torch_threads)
        engine = LLMEngine(EngineConfig(model=args.model, max_model_len=512, max_num_seqs=64))
        config = ServerConfig(served_model_name="load-test", port=0, log_level="warning")
        args.admit_ahead_seqs = args.admit_ahead_seqs or ADMIT_AHEAD_SEQS
        app = create_app(engine, config, admit_ahead_seqs=args.admit_ahead_seqs)
        server = start_in_background(app, config)
        base_url = server.url
    model = httpx.get(f"{base_url}/v1/models", timeout=30,
                      headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
                      ).json()["data"][0]["id"]  # fmt: skip
    if args.giant:
        try:
            result = asyncio.run(giant_then_small(base_url, model, args))
        finally:
            if server is not None:
                server.stop()
        print(json.dumps(result, indent=2))
        return 0 if result["small_status"] == 200 else 1
    try:
        outcomes, wall_s = asyncio.run(run_load(base_url, model, args))
        report = summarize(outcomes, wall_s, base_url, args)
    finally:
        if server is not None:
            server.stop()
    result = asdict(report)
    if args.engine_baseline and engine is not None:
        baseline = engine_baseline_tokens_per_s(engine, report.requests, args)
        result["engine_baseline_generated_tokens_per_s"] = round(baseline, 1)
    for name, value in result.items():
        print(f"{name:38} {value}")
    for o in outcomes:
        if o.error:
            print(f"error: {o.error}", file=sys.stderr)
    if args.json:  # the printed report, and what measured it
        write_json(args.json, {**result, "meta": finish_meta(meta)})
    return 1 if report.lost or report.kv_blocks_used_after else 0


if __name__ == "__main__":
    sys.exit(main())
