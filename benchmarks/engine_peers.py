"""The engines ``bench_engine.py`` compares, behind one call each: run these prompts (token ids)
to these output lengths, greedy, EOS ignored; return (seconds, useful output tokens).

* pagedkv: a fresh engine per run (so no run reuses an earlier run's prefix cache).
* transformers ``generate``: static batches, left-padded; a batch runs until its longest output
  (what static batching costs), only the requested tokens count as useful.
* llama.cpp (llama-cpp-python, ``make bench-peers``): one request at a time, on the GGUF's own
  quantized weights (Q4_1), so its tokens are not a bit-exact reference.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import torch

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts


def engine_on(loaded, **overrides) -> LLMEngine:
    settings = {"log_startup": False, "max_model_len": 2048, "max_num_seqs": 64,
                "kv_cache_memory_bytes": 1 << 30, **overrides}  # fmt: skip
    config = EngineConfig(**settings)
    return LLMEngine(config, parts=build_parts(config, loaded))


def run_pagedkv(loaded, ids: list[list[int]], new_tokens: list[int], **overrides):
    engine = engine_on(loaded, **overrides)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in new_tokens]
    t0 = time.perf_counter()
    outs = engine.generate(ids, params)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


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
