"""Soak the whole cluster under chaos: every request answered or cleanly refused, nothing lost.

A router, three replicas (one the decode side of a P/D pair), the prefill instance and Redis
(``soak_cluster.py``), all on loopback. For ``--minutes`` minutes, ``--clients`` threads send a
mix of streaming and non-streaming completions over shared prefixes, some leaving mid-stream,
while a chaos thread every ``--fault-every`` seconds SIGSTOPs (and later SIGCONTs) or SIGKILLs
(and restarts) a replica, Redis or the prefill instance. Then the chaos stops, everything is
healed, and the run checks:

* every request was **answered** (a complete answer), **refused** (a clean HTTP error with a JSON
  body, or a stream that ends with an error event) or **abandoned** (the client left); **lost**
  (no clean answer: the router's connection failed, a stream cut without an error event, a
  non-JSON error) must be 0;
* **zero KV blocks in use** on every replica and the prefill instance once the load is gone;
* the **router's memory** (RSS sampled every 2 s) at start and end;
* the router **routes to every live replica** afterwards (fresh prompts, counted per replica
  in its ``/metrics``).

    python benchmarks/soak.py --minutes 3 [--clients 6] [--fault-every 8] [--seed 0]

Exit status 1 when a check fails. Results: ``--out`` (JSON, with the machine's load).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from common import finish_meta, machine_line, machine_meta, write_json
from soak_cluster import REPLICAS, Cluster

PREFIXES = [f"topic {k}: " + " ".join(f"w{k}{i}" for i in range(24)) for k in range(8)]
MODEL = ["?"]  # the served model's name, read from the router's /v1/models at start
FAULTS = ("stop_replica", "kill_replica", "kill_redis", "stop_prefill", "kill_prefill")


def one_request(
    client: httpx.Client,
    url: str,
    rng: random.Random,
    reasons: Counter | None = None,
    prefix: str | None = None,
) -> str:
    """Send one request; its outcome: answered, refused, abandoned or lost (a refusal's error
    code, or a loss's cause, is counted in ``reasons``)."""
    reasons = Counter() if reasons is None else reasons
    prompt = (
        (prefix or rng.choice(PREFIXES)) + " " + " ".join(str(rng.randrange(999)) for _ in range(8))
    )
    body = {"model": MODEL[0], "prompt": prompt, "max_tokens": rng.randrange(4, 24),
            "temperature": 0, "stream": rng.random() < 0.5}  # fmt: skip
    try:
        if not body["stream"]:
            resp = client.post(f"{url}/v1/completions", json=body)
            if resp.status_code == 200:
                return "answered" if resp.json().get("choices") else "lost"
            return _refused(resp.status_code, resp.json(), reasons)
        leave_after = rng.randrange(1, 4) if rng.random() < 0.2 else None
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                return _refused(resp.status_code, resp.json(), reasons)
            events = 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "answered"
                if '"error"' in line:  # the stream ends with an error event: clean
                    reasons[f"stream {json.loads(line[6:])['error'].get('code')}"] += 1
                    return "refused"
                events += 1
                if leave_after is not None and events >= leave_after:
                    return "abandoned"
            reasons["lost: stream cut without [DONE] or an error event"] += 1
            return "lost"
    except (httpx.HTTPError, ValueError) as exc:
        reasons[f"lost: {type(exc).__name__}"] += 1
        return "lost"


def _refused(status: int, body: object, reasons: Counter) -> str:
    """A clean refusal is an HTTP error with an OpenAI-style JSON error body."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        reasons[f"{status} {body['error'].get('code') or body['error'].get('type')}"] += 1
        return "refused"
    reasons[f"lost: {status} without a JSON error"] += 1
    return "lost"


def clients(
    url: str, num_clients: int, seed: int, stop: threading.Event, out: Counter, reasons: Counter
) -> list:
    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(timeout=90.0) as client:
            while not stop.is_set():
                outcome = one_request(client, url, rng, reasons)
                out[outcome] += 1  # Counter += is one bytecode op per key under the GIL: fine

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(num_clients)]
    for t in threads:
        t.start()
    return threads


def chaos(cluster: Cluster, every_s: float, seed: int, stop: threading.Event, faults: Counter):
    rng = random.Random(seed)
    while not stop.wait(every_s):
        kind = rng.choice(FAULTS)
        faults[kind] += 1
        try:
            _inject(cluster, kind, rng, stop)
        except Exception as exc:  # noqa: BLE001 - a fault that cannot be undone is a finding
            faults[f"{kind} failed: {exc}"[:200]] += 1


def _inject(cluster: Cluster, kind: str, rng: random.Random, stop: threading.Event) -> None:
    """One fault of ``kind``; a stopped process is continued, a killed one restarted."""
    if kind == "stop_replica" or kind == "stop_prefill":
        proc = cluster.procs["prefill" if kind == "stop_prefill" else rng.choice(REPLICAS)]
        proc.signal(signal.SIGSTOP)
        stop.wait(rng.uniform(2.0, 6.0))
        proc.signal(signal.SIGCONT)
    elif kind == "kill_replica":
        cluster.restart(rng.choice(REPLICAS))
    elif kind == "kill_prefill":
        cluster.restart("prefill")
    else:
        cluster.restart("redis")


def metric(url: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels.strip()] = float(value)
    return out


def wait_for(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return check()


def final_checks(cluster: Cluster, seed: int) -> dict:
    router = cluster.router.url
    names = {cluster.procs[n].url: n for n in REPLICAS}
    up = wait_for(lambda: all(v == 1.0 for v in metric(router, "pagedkv_router_replica_up")
                              .values()), 120)  # fmt: skip
    before = metric(router, "pagedkv_router_requests_total")
    rng = random.Random(seed + 7)
    with httpx.Client(timeout=90.0) as client:
        # Prefixes no replica holds: the policy spreads them by load, ties in turn, so every
        # live replica must get some (a seen prefix goes where it is cached, by design).
        outcomes = Counter(one_request(client, router, rng, prefix=f"fresh {i}: " + "x " * 20)
                           for i in range(30))  # fmt: skip
    after = metric(router, "pagedkv_router_requests_total")
    routed = Counter()
    for labels, value in after.items():
        for url, name in names.items():
            if f'replica="{url}"' in labels:
                routed[name] += value - before.get(labels, 0.0)
    procs = [*REPLICAS, "prefill"]
    used: dict[str, float] = {}

    def drained() -> bool:
        for n in procs:
            used[n] = sum(metric(cluster.procs[n].url, "pagedkv_kv_blocks_used").values())
        return not any(used.values())

    wait_for(drained, 60)
    return {"all_replicas_up": up, "final_outcomes": dict(outcomes),
            "routed_after": dict(routed), "blocks_in_use": used}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="chaos time (default 3)")
    parser.add_argument("--clients", type=int, default=6, help="client threads (default 6)")
    parser.add_argument("--fault-every", type=float, default=8.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/soak.json"))
    args = parser.parse_args()
    meta = machine_meta(minutes=args.minutes, clients=args.clients, seed=args.seed,
                        fault_every_s=args.fault_every)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pagedkv-soak-") as tmp:
        cluster = Cluster(Path(tmp)).start()
        try:
            models = httpx.get(f"{cluster.router.url}/v1/models", timeout=30).json()
            MODEL[0] = models["data"][0]["id"]
            outcomes, faults, reasons, rss = Counter(), Counter(), Counter(), []
            stop = threading.Event()
            threads = clients(cluster.router.url, args.clients, args.seed, stop, outcomes, reasons)
            threads.append(threading.Thread(target=chaos, daemon=True,
                                            args=(cluster, args.fault_every, args.seed, stop,
                                                  faults)))  # fmt: skip
            threads[-1].start()
            end = time.monotonic() + args.minutes * 60
            while time.monotonic() < end:
                rss.append(cluster.router.rss_bytes())
                print(f"soak: {dict(outcomes)} faults {dict(faults)} router RSS "
                      f"{rss[-1] / 2**20:.0f} MiB", flush=True)  # fmt: skip
                time.sleep(2.0)
            stop.set()
            for t in threads:
                t.join(120)
            cluster.heal()
            checks = final_checks(cluster, args.seed)
            rss.append(cluster.router.rss_bytes())
        finally:
            cluster.stop()
    sent = sum(outcomes.values())
    result = {"meta": finish_meta(meta), "sent": sent, **{k: outcomes.get(k, 0) for k in
              ("answered", "refused", "abandoned", "lost")}, "reasons": dict(reasons),
              "faults": dict(faults),
              "router_rss_mib": {"start": rss[0] / 2**20, "end": rss[-1] / 2**20,
                                 "max": max(rss) / 2**20}, **checks}  # fmt: skip
    write_json(args.out, result)
    print(machine_line(result["meta"]))
    print({k: v for k, v in result.items() if k != "meta"})
    live = [n for n in REPLICAS if checks["routed_after"].get(n, 0) < 1]
    ok = result["lost"] == 0 and not any(checks["blocks_in_use"].values()) and not live
    print("soak:", "PASS" if ok else f"FAIL (lost {result['lost']}, not routed to {live})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
