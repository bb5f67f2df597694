"""Swap vs recompute on this machine: the engine-side twin of the paper's swap/recompute figure.

For each block size B (1, 8, 16, 64, 128), with the embedded model's KV layout (SmolLM2-135M:
30 layers x 3 KV heads x 64 dims, fp32 = 46,080 bytes per token):

* swap: the engine's own batched copy path (``engine/kv/swap_pool.py HostSwapPool``: one
  ``index_select`` + ``index_copy_`` per layer and tensor over every block of the step) moves
  1 GiB worth of KV (``ceil(1 GiB / block bytes)`` blocks, scattered ids) device -> host
  (swap-out) and host -> device (swap-in), on real pools of the engine's layout
  (``model/kv_pool.py allocate_kv_caches``). Both pools live in this machine's RAM: the
  figure is memory bandwidth and gather/scatter overhead, there is no PCIe link here.
* recompute: the same tokens' prefill through ``LLMEngine`` (paged policy at block size B):
  ``--recompute-tokens`` (default 2,048, one max_model_len sequence) are timed and the figure is
  scaled linearly to the 23,302 tokens of 1 GiB, i.e. 1 GiB counted as sequences of
  ``--recompute-tokens`` tokens each (what recompute preemption would prefill again).

Every figure is the median of ``--repeats`` runs after one warm-up (every run is kept in the
JSON's ``samples_s``). One torch thread by default: on a shared 2-core machine an OpenMP team
of 2 that loses a core stalls at every barrier, which made 2-thread figures bimodal (x6).
A table is printed, JSON goes to ``results/bench_swap.json``. Nothing here is asserted.

    python benchmarks/bench_swap.py [--repeats 5] [--block-sizes 1,8,16,64,128] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from common import finish_meta, machine_meta, samples_s, write_json
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.kv.swap_pool import HostSwapPool
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model
from pagedkv.model.kv_pool import allocate_kv_caches
from pagedkv.pages.page_format import PageFormat

GIB = 1 << 30


SAMPLES: dict[str, list[float]] = {}  # every timed run, by label: kept in the JSON


def median_s(fn, repeats: int, label: str) -> float:
    """Median seconds after a warm-up (it commits the host pool's pages, fills caches); every
    run kept in ``SAMPLES[label]``."""
    times = samples_s(fn, repeats)
    SAMPLES[label] = [round(t, 4) for t in times]
    return statistics.median(times)


def swap_times(config, block_size: int, repeats: int, seed: int) -> dict:
    """Median seconds to swap 1 GiB of KV out and back in through ``HostSwapPool``."""
    record_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    num_blocks = math.ceil(GIB / (record_bytes * block_size))
    page = PageFormat.mha(config.num_layers, config.num_kv_heads, config.head_dim, "fp32",
                          block_size)  # fmt: skip
    device = allocate_kv_caches(page, num_blocks + 1)
    for k, v in device:
        k.normal_()
        v.normal_()
    host = HostSwapPool(page, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    # Scattered ids, as a pool in use gives them; block 0 is the null block.
    device_ids = torch.randperm(num_blocks, generator=gen) + 1
    host_ids = torch.randperm(num_blocks, generator=gen)
    out_pairs = torch.stack([device_ids, host_ids], dim=1).tolist()
    back_ids = torch.randperm(num_blocks, generator=gen) + 1  # fresh blocks elsewhere
    in_pairs = torch.stack([host_ids, back_ids], dim=1).tolist()
    out_s = median_s(lambda: host.swap_out(device, out_pairs), repeats, f"swap_out B={block_size}")
    in_s = median_s(lambda: host.swap_in(device, in_pairs), repeats, f"swap_in B={block_size}")
    moved = num_blocks * host.block_bytes
    return {
        "blocks": num_blocks,
        "block_bytes": record_bytes * block_size,
        "bytes": moved,
        "swap_out_s": out_s,
        "swap_in_s": in_s,
        "swap_out_gib_per_s": moved / GIB / out_s,
        "swap_in_gib_per_s": moved / GIB / in_s,
    }


def recompute_time(loaded, block_size: int, num_tokens: int, repeats: int) -> float:
    """Median seconds of a ``num_tokens`` prefill through the engine (one sampled token)."""
    config = EngineConfig(
        policy="vllm",
        block_size=block_size,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=max(num_tokens + 1, 2048),
        max_num_batched_tokens=num_tokens,
        log_startup=False,
    )
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    vocab = loaded[0].vocab_size
    counter = iter(range(1, 10**6))

    def prefill() -> None:
        k = next(counter)  # a new prompt every time: no prefix hit
        (out,) = engine.generate([[(k * 7919 + t * 31) % vocab for t in range(num_tokens)]], params)
        assert out.error is None and out.num_cached_tokens == 0

    return median_s(prefill, repeats, f"recompute {num_tokens} tokens B={block_size}")


def table(rows: list[dict], num_tokens: int) -> str:
    lines = [
        f"| B | blocks in 1 GiB | swap-out | swap-in | swap out+in | recompute "
        f"(scaled from {num_tokens} tokens) | recompute / swap |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        both = r["swap_out_s"] + r["swap_in_s"]
        lines.append(
            f"| {r['block_size']} | {r['blocks']:,} | {r['swap_out_s'] * 1e3:.0f} ms "
            f"({r['swap_out_gib_per_s']:.1f} GiB/s) | {r['swap_in_s'] * 1e3:.0f} ms "
            f"({r['swap_in_gib_per_s']:.1f} GiB/s) | {both * 1e3:.0f} ms | "
            f"{r['recompute_1gib_s']:.1f} s | {r['recompute_1gib_s'] / both:.0f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--recompute-repeats", type=int, default=3)
    parser.add_argument("--block-sizes", default="1,8,16,64,128")
    parser.add_argument("--recompute-tokens", type=int, default=2048)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: a team of 2 that loses a core to another job stalls)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench_swap.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_meta()
    loaded = load_model(None, progress=False)
    config = loaded[0]
    record_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    tokens_1gib = GIB / record_bytes
    rows = []
    for i, block_size in enumerate(int(b) for b in args.block_sizes.split(",")):
        row = {"block_size": block_size, **swap_times(config, block_size, args.repeats, i)}
        t = recompute_time(loaded, block_size, args.recompute_tokens, args.recompute_repeats)
        row["recompute_measured_s"] = t
        row["recompute_1gib_s"] = t * tokens_1gib / args.recompute_tokens
        rows.append(row)
        print(f"B={block_size}: {json.dumps({k: round(v, 4) for k, v in row.items()})}")
    result = {
        "meta": {
            **finish_meta(machine),
            "torch": torch.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability(),
            "threads": args.threads,
            "repeats": args.repeats,
            "recompute_repeats": args.recompute_repeats,
            "record_bytes": record_bytes,
            "tokens_in_1gib": tokens_1gib,
            "recompute_tokens_measured": args.recompute_tokens,
            "recompute_scaling": "linear: measured seconds x tokens_in_1gib / recompute_tokens",
        },
        "rows": rows,
        "samples_s": SAMPLES,
    }
    print(table(rows, args.recompute_tokens))
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
