"""TTFT of a shared 1,500-token prompt by the tier that holds its prefix: cold (recomputed),
device hit, host hit (and a store hit where a store is plugged in), in one run.

The embedded SmolLM2-135M (fp32), paged B = 16, a device pool of ``--pool-tokens`` slots (room
for the prompt, not for the prompt and the distractors) and a host tier of ``--host-memory``.
Each repeat, on one engine:

* **cold**: the prompt under a fresh ``cache_salt`` (nothing anywhere can hit);
* **device**: the same request again (its blocks are cached on the device);
* **host**: two distractor prompts evict every block of it from the device into the host tier
  (checked: the request's hit must come from the host tier only), then the request again;
* **store**: ``measure_store``: a writer engine computes the prompt (write-through to Redis),
  then a second engine with its own device pool and no host tier reads every block from the
  store (checked: a pure store hit). ``--kv-store URL``, or a redis-server started here.

TTFT = time of one max_tokens=1 request (its prefill step plus the sample), twice: wall time,
and this process's CPU time (``time.process_time``). On a machine shared with other jobs the
wall time also measures their load (seen here: the same cold prefill 2.5 s and 16 s); with one
torch thread the CPU time is the work this request cost, and is the column to compare. Medians
over the repeats and their ratios to cold. Writes results/bench_tiers.json and prints a
markdown table.

    python benchmarks/bench_tiers.py [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import finish_meta, machine_meta, medians, ratios, write_json
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model

PROMPT_TOKENS = 1500
BLOCK_SIZE = 16
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)
COLUMNS = ("cold", "device", "host", "store")


def prompt_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 100, (n,), generator=g).tolist()


def ttft_s(
    engine: LLMEngine, prompt: list[int], salt: str
) -> tuple[tuple[float, float], dict[str, int]]:
    """(wall, CPU) seconds of one max_tokens=1 request, and the hit tokens it got per tier."""
    before = dict(engine.allocator.stats().tier_hit_tokens)
    request_id = engine.add_request(prompt, ONE_TOKEN, cache_salt=salt)
    start, cpu = time.perf_counter(), time.process_time()
    while True:
        outs = [o for o in engine.step() if o.request_id == request_id and o.finished]
        if outs:
            break
    elapsed = (time.perf_counter() - start, time.process_time() - cpu)
    after = dict(engine.allocator.stats().tier_hit_tokens)
    return elapsed, {t: after[t] - before.get(t, 0) for t in after}


def measure_store(
    args: argparse.Namespace, parts, prompt: list[int]
) -> list[tuple[float, float]] | None:
    """(wall, CPU) TTFT of store hits: per repeat, a writer engine computes the prompt under a fresh salt
    (write-through, flushed), then a second engine -- its own device pool, no host tier, the
    same process and weights -- reads the prompt's blocks from the store (checked: its hit
    comes from the store tier only). ``--kv-store URL``, or a redis-server this benchmark
    starts on a free loopback port (and stops by PID); None when neither is available."""
    url, server = args.kv_store, None
    if url is None:
        server = _start_redis()
        if server is None:
            return None
        url = f"redis://127.0.0.1:{server[1]}"
    try:
        loaded = (parts.model_config, parts.model, parts.tokenizer)
        config = EngineConfig(
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=args.pool_tokens * 46080,
            max_model_len=2048,
            log_startup=True,
            kv_store=url,
        )
        writer = LLMEngine(config, parts=build_parts(config, loaded))
        reader = LLMEngine(config, parts=build_parts(config, loaded))
        store = reader.parts.kv_store
        times, writes = [], []
        for r in range(args.repeats):
            salt = f"store-repeat-{r}"
            t, _ = ttft_s(writer, prompt, salt)  # cold, with write-through of its 93 blocks
            writes.append(t)
            assert writer.parts.kv_store.flush(60)
            t, hit = ttft_s(reader, prompt, salt)
            assert hit.get("store", 0) > 0 and hit["device"] == 0, f"not a store hit: {hit}"
            times.append(t)
        wall, cpu = (statistics.median(x) for x in zip(*writes, strict=True))
        print(f"cold with write-through to the store: median {wall * 1000:.0f} ms wall, "
              f"{cpu * 1000:.0f} ms CPU")  # fmt: skip
        print(f"store reader counters: {store.counters.as_dict()}")
        return times
    finally:
        if server is not None:
            server[0].kill()
            server[0].wait()


def _start_redis():
    """(process, port) of a fresh redis-server on a free loopback port, or None."""
    import shutil
    import socket
    import subprocess

    binary = shutil.which("redis-server")
    if binary is None:
        print("no redis-server (make redis): the store column is left out")
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def run(args: argparse.Namespace) -> dict:
    meta = machine_meta()
    loaded = load_model(None, progress=False)
    vocab = loaded[0].vocab_size
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=args.pool_tokens * 46080,  # SmolLM2: 46,080 KV bytes per token
        host_kv_memory_bytes=args.host_memory_mib << 20,
        max_model_len=2048,
        log_startup=True,
    )
    parts = build_parts(config, loaded)
    engine = LLMEngine(config, parts=parts)
    prompt = prompt_ids(vocab, PROMPT_TOKENS, 1)
    distractors = [prompt_ids(vocab, args.distractor_tokens, 2 + i) for i in range(2)]
    ttft_s(engine, prompt_ids(vocab, 64, 99), "warm-up")
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in COLUMNS}
    splits: list[dict[str, int]] = []
    for r in range(args.repeats):
        salt = f"repeat-{r}"
        t, hit = ttft_s(engine, prompt, salt)
        assert sum(hit.values()) == 0, hit
        times["cold"].append(t)
        t, hit = ttft_s(engine, prompt, salt)
        assert hit.get("host", 0) == 0 and hit["device"] > 0, hit
        times["device"].append(t)
        for i, d in enumerate(distractors):
            ttft_s(engine, d, f"distractor-{r}-{i}")
        t, hit = ttft_s(engine, prompt, salt)
        assert hit["device"] == 0 and hit["host"] > 0, f"not a pure host hit: {hit}"
        times["host"].append(t)
        splits.append(hit)
    store = measure_store(args, parts, prompt)
    if store is not None:
        times["store"] = store
    wall = medians({c: [w for w, _ in v] for c, v in times.items()})
    cpu = medians({c: [p for _, p in v] for c, v in times.items()})
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "block_size": BLOCK_SIZE,
        "pool_tokens": args.pool_tokens,
        "host_memory_mib": args.host_memory_mib,
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ttft_wall_cpu_s": times,
        "median_ttft_wall_s": wall,
        "median_ttft_cpu_s": cpu,
        "ratio_to_cold_wall": ratios(wall, "cold"),
        "ratio_to_cold_cpu": ratios(cpu, "cold"),
        "host_hit_split_tokens": splits[-1] if splits else {},
        "tier_moves": _moves(engine),
        "meta": finish_meta(meta),
    }


def _moves(engine: LLMEngine) -> dict[str, int]:
    moves = engine.snapshot().tier_moves
    if moves is None:
        return {}
    return {f"{t}/{k}": n for (t, k), n in moves.blocks.items()}


def table(result: dict, fmt: Callable[[float], str] = lambda s: f"{s * 1000:.0f} ms") -> str:
    cols = [c for c in COLUMNS if c in result["median_ttft_cpu_s"]]
    lines = ["| " + " | ".join(["", *cols]) + " |", "|" + "---|" * (len(cols) + 1)]
    for clock in ("cpu", "wall"):
        medians, ratios = result[f"median_ttft_{clock}_s"], result[f"ratio_to_cold_{clock}"]
        cells = " | ".join(fmt(medians[c]) for c in cols)
        lines.append(f"| TTFT median ({clock}) | {cells} |")
        cells = " | ".join(f"{ratios[c]:.1f}x" for c in cols)
        lines.append(f"| cold / this ({clock}) | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pool-tokens", type=int, default=1600, help="device KV pool, tokens")
    parser.add_argument("--distractor-tokens", type=int, default=1000)
    parser.add_argument("--host-memory-mib", type=int, default=256)
    parser.add_argument("--kv-store", help="redis://HOST:PORT (default: start a redis-server)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_tiers.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run(args)
    write_json(args.out, result)
    print(table(result))
    print(f"host hit split (tokens): {result['host_hit_split_tokens']}")
    print(f"tier copies (blocks): {result['tier_moves']}")


if __name__ == "__main__":
    main()
