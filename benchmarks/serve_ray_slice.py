"""The workload of ``bench_serve_ray.py``: multi-turn conversations of the Mooncake trace,
scaled to a CPU, its open-loop replay against an endpoint, and the simulator's prediction (``pagedkv simulate --replicas``'s
own ``Cluster``, on a cost profile of this machine).

**The slice.** Mooncake's ``conversation`` trace names each 512-token prefix block
(``hash_ids``); a conversation's next turn starts with its earlier turns' blocks. Within a
window of the trace the requests are grouped by their first block after the shared system
block (``hash_ids[1]``: a conversation's first user block); groups with at least
``min_turns`` requests are kept, the first ``conversations`` of them, every turn in trace
order. So every request of the slice shares its conversation's history with an earlier one:
the workload a prefix-aware router is for.

**Scaling.** Each 512-token block becomes ``block_tokens`` tokens (the same block id, the
same tokens: shared prefixes stay shared), a prompt is cut to ``max_prompt`` tokens (its
leading blocks), an output is ``output_len / output_divisor`` capped at ``max_output``, and the
arrival times are multiplied by ``time_scale``. A block's tokens are drawn from the model's
vocabulary by a generator seeded with the block id.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from pagedkv.traces import TraceRequest, load_trace, require_shared_trace

TRACE = "mooncake_conversation.jsonl"
SEGMENT_TOKENS = 512


@dataclass(frozen=True)
class SliceSpec:
    window: int = 1500  # requests of the trace the conversations are taken from
    conversations: int = 14
    min_turns: int = 3
    block_tokens: int = 32
    max_prompt: int = 1536
    output_divisor: int = 16
    max_output: int = 32
    time_scale: float = 0.25

    def describe(self) -> str:
        return (
            f"Mooncake {TRACE}: the first {self.conversations} conversations of >= "
            f"{self.min_turns} turns among its first {self.window} requests; 512-token "
            f"blocks as {self.block_tokens} tokens, prompts <= {self.max_prompt}, outputs "
            f"/{self.output_divisor} (<= {self.max_output}), times x{self.time_scale}"
        )


def conversation_slice(spec: SliceSpec) -> list[TraceRequest]:
    """The scaled requests (arrivals from 0), in trace order."""
    raw = load_trace(require_shared_trace(TRACE), spec.window)
    groups: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(raw):
        if len(r.prompt) > 1:
            groups[r.prompt[1][0]].append(i)
    kept = [g for g in groups.values() if len(g) >= spec.min_turns][: spec.conversations]
    chosen = sorted(i for g in kept for i in g)
    t0 = raw[chosen[0]].arrival_time_s
    out = []
    for i in chosen:
        r = raw[i]
        prompt, total = [], 0
        for seg_id, n in r.prompt:
            take = min(max(1, n * spec.block_tokens // SEGMENT_TOKENS), spec.max_prompt - total)
            if take <= 0:
                break
            prompt.append((seg_id, take))
            total += take
        output = min(spec.max_output, max(1, r.output_len_tokens // spec.output_divisor))
        out.append(TraceRequest((r.arrival_time_s - t0) * spec.time_scale, tuple(prompt), output))
    return out


def prompt_token_ids(req: TraceRequest, vocab_size: int) -> list[int]:
    """The prompt's token ids: each block's from a generator seeded with its id (a block
    shorter than another of its id is a prefix of it, as in the trace)."""
    ids: list[int] = []
    for seg_id, n in req.prompt:
        rng = random.Random(seg_id)
        ids.extend(rng.randrange(10, vocab_size - 10) for _ in range(n))
    return ids


def replay(base: str, requests, vocab_size: int) -> dict:
    """Each request sent at its arrival time (open loop); the answers' usage and timing."""
    rows: list[dict] = [{} for _ in requests]
    t0 = time.perf_counter()

    def send(i: int) -> None:
        r = requests[i]
        time.sleep(max(0.0, r.arrival_time_s - (time.perf_counter() - t0)))
        body = {
            "prompt": prompt_token_ids(r, vocab_size),
            "max_tokens": r.output_len_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        sent = time.perf_counter()
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=1800)
        resp.raise_for_status()
        usage = resp.json()["usage"]
        rows[i] = {
            "latency_s": time.perf_counter() - sent,
            "end_s": time.perf_counter() - t0,
            "prompt": usage["prompt_tokens"],
            "output": usage["completion_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "replica": resp.headers["x-pagedkv-replica"],
        }

    with ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(send, range(len(requests))))
    makespan = max(r["end_s"] for r in rows)
    lat = sorted(r["latency_s"] for r in rows)
    return {
        "hit_rate": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
        "makespan_s": makespan,
        "requests_per_s": len(rows) / makespan,
        "output_tokens_per_s": sum(r["output"] for r in rows) / makespan,
        "p50_latency_s": statistics.median(lat),
        "p90_latency_s": lat[int(0.9 * len(lat))],
        "split": sorted(Counter(r["replica"] for r in rows).values()),
    }


def simulate(
    requests: Sequence[TraceRequest],
    profile_path: str,
    num_kv_slots: int,
    block_size: int,
    router: str,
    balance_abs: int,
    max_num_seqs: int,
) -> dict:
    """``pagedkv simulate --replicas 2 --router ROUTER``'s cluster run of ``requests``
    (its summary: prefix hit tokens, duration, latencies)."""
    from pagedkv.kvcache.policies import get_policy
    from pagedkv.sched import SchedulerConfig
    from pagedkv.sim.cluster import Cluster
    from pagedkv.sim.cluster_summary import cluster_ideal_hits, summarize_cluster
    from pagedkv.sim.costs.profiled import read_cost_profile

    cost = read_cost_profile(profile_path).cost_model()
    policy = get_policy(f"paged:{block_size}")
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=2048)
    result = Cluster(
        list(requests), policy, num_kv_slots, config, cost, 2, router, balance_abs=balance_abs
    ).run()
    return summarize_cluster(
        result, cluster_ideal_hits(requests, result), balance=(balance_abs, 0.25)
    )
