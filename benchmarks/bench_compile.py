"""Does ``torch.compile`` pay on this CPU? Batch-1 decode of the embedded SmolLM2, eager vs
compiled (inductor, ``dynamic=True``), in one process, interleaved.

Two copies of the model are loaded; in the second, every decoder layer's ``forward`` (or only
its MLP, ``--scope mlp``, or the two halves around attention, ``--scope halves``) is wrapped in
``torch.compile``. The compile time is the first
generation's wall time minus an eager one of the same length. Then the two engines alternate
``--repeats`` times, each generating ``--tokens`` greedy tokens after a fresh 32-token prompt;
the table shows medians of milliseconds per output token. Last, both generate greedily from one
prompt and the script says whether the tokens are the same.

    python benchmarks/bench_compile.py [--threads 2] [--repeats 5] [--tokens 64]
        [--scope layer|mlp|halves]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from common import alternate, finish_meta, machine_meta, medians, write_json
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--scope", choices=["layer", "mlp", "halves"], default="layer",
                    help="what is compiled: each decoder layer, its MLP, or the two halves "
                         "around attention (attention eager)")  # fmt: skip
    ap.add_argument("--out", default="results/bench_compile.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    meta = machine_meta()
    rng = random.Random(0)
    cfg = EngineConfig(log_startup=False, max_model_len=2048, kv_cache_memory_bytes=1 << 28)

    def engine(loaded) -> LLMEngine:
        return LLMEngine(cfg, parts=build_parts(cfg, loaded))

    def ms_per_token(eng: LLMEngine) -> float:
        ids = [rng.randrange(100, 40000) for _ in range(32)]
        params = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        eng.generate([ids], params)
        return (time.perf_counter() - t) / a.tokens * 1e3

    eager = engine(load_model(None, progress=False))
    ms_per_token(eager)  # warm-up
    compiled_model = load_model(None, progress=False)
    for layer in compiled_model[1].layers:
        if a.scope == "layer":
            layer.forward = torch.compile(layer.forward, dynamic=True)
        elif a.scope == "halves":
            layer.attention_inputs = torch.compile(layer.attention_inputs, dynamic=True)
            layer.attention_outputs = torch.compile(layer.attention_outputs, dynamic=True)
        else:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
    compiled = engine(compiled_model)
    first_ms = ms_per_token(compiled)
    compile_s = (first_ms - ms_per_token(eager)) * a.tokens / 1e3
    runs = {"eager": lambda: ms_per_token(eager), "compiled": lambda: ms_per_token(compiled)}
    times = alternate(runs, a.repeats)
    med = medians(times)
    probe = [rng.randrange(100, 40000) for _ in range(32)]
    greedy = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0.0)
    same = [e.generate([probe], greedy)[0].outputs[0].token_ids for e in (eager, compiled)]
    same_tokens = same[0] == same[1]
    result = {"threads": a.threads, "scope": a.scope, "tokens": a.tokens, "repeats": a.repeats,
              "compile_s": round(compile_s, 1), "ms_per_token": med, "runs": times,
              "greedy_tokens_equal": same_tokens,
              "torch": torch.__version__, "meta": finish_meta(meta)}  # fmt: skip
    print(f"| batch-1 decode, {a.threads} threads | ms/token (median of {a.repeats}) |")
    print("|---|---:|")
    print(f"| eager | {med['eager']:.1f} |")
    print(f"| torch.compile ({a.scope}s, dynamic) | {med['compiled']:.1f} |")
    print(
        f"compile time (first generation, beyond eager): {compile_s:.1f} s; "
        f"greedy tokens equal to eager's: {same_tokens}"
    )
    write_json(a.out, result)


if __name__ == "__main__":
    main()
