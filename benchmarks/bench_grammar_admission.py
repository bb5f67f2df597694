"""What the grammar probe (``engine/structured/probe.py``, issue 53) costs a constrained request.

A spec is compiled and probed once, when the first request with it is admitted; later requests
reuse the cached prototype. So the probe's cost is paid by a request whose spec is new, and this
measures exactly that case, the worst one: every request gets a schema never seen before (a
unique ``description`` keeps the cache cold), with the probe on and off (``probe`` replaced by a
no-op), alternated round by round on the embedded model:

1. **compile**: ``GrammarCache.compile`` of each schema of ``bench_grammar.SCHEMAS`` and a
   forced tool call's grammar, cold (process CPU time);
2. **request**: one constrained chat request per schema end to end (admission, then 48 tokens
   at temperature 1, seeded), process CPU time of ``LLMEngine.generate``.

Both on one torch thread and in process CPU time, so other jobs on a shared machine do not
inflate either side.

The ratio of medians (probe on / off) is the probe's cost; the target is at most 1.05.

    python benchmarks/bench_grammar_admission.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from bench_grammar import SCHEMAS
from common import finish_meta, machine_line, machine_meta, round_order

MODES = ("probe", "no probe")
NEW_TOKENS = 48


def fresh(schema: dict, salt: str) -> dict:
    """``schema`` under a new cache key: same language, a description nobody sent before."""
    return {**schema, "description": salt}


def specs(salt: str) -> dict:
    from pagedkv.engine.structured.spec import StructuredOutput
    from pagedkv.server.forced_calls import forced_calls
    from pagedkv.server.structured_params import JsonRules

    out = {n: StructuredOutput.of_schema(fresh(s, salt), "s") for n, s in SCHEMAS.items()}
    tool = {"type": "function", "function": {"name": "get_weather",
            "parameters": fresh(SCHEMAS["address"], salt)}}  # fmt: skip
    out["forced call"] = forced_calls([tool], True, True, JsonRules()).grammar
    return out


def probing(mode: str):
    """The probe as it is, or replaced by one that admits everything."""
    from pagedkv.engine.structured import grammar

    return mock.patch.object(grammar, "probe", grammar.probe if mode == "probe" else lambda *a: "")


def compile_s(engine, mode: str, salt: str) -> dict[str, float]:
    out = {}
    with probing(mode):
        for name, spec in specs(salt).items():
            start = time.process_time()
            engine.grammars.compile(spec)
            out[name] = time.process_time() - start
    return out


def request_s(engine, mode: str, salt: str) -> float:
    from pagedkv.engine import SamplingParams

    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Reply in JSON."}])
    total = 0.0
    with probing(mode):
        for spec in specs(salt).values():
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=3, structured=spec)
            start = time.process_time()
            (out,) = engine.generate([prompt], params)
            total += time.process_time() - start
            assert out.error is None, out.error
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from pagedkv.engine import EngineConfig, LLMEngine

    meta = machine_meta()
    print(f"machine: {machine_line(meta)}")
    engine = LLMEngine(EngineConfig(log_startup=False, max_model_len=1024))
    request_s(engine, "probe", "warm-up")  # llguidance's tokenizer, kernels, caches
    compiled: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    requests: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in round_order(MODES, r):
            for name, s in compile_s(engine, mode, f"c{r}{mode}").items():
                compiled[mode].setdefault(name, []).append(s)
            requests[mode].append(request_s(engine, mode, f"r{r}{mode}"))
    print(f"\n## cold compile, CPU ms (median of {args.rounds} rounds)\n")
    print("| spec | probe | no probe | probe's share |\n|---|---|---|---|")
    for name in compiled["probe"]:
        on, off = (statistics.median(compiled[m][name]) * 1e3 for m in MODES)
        print(f"| {name} | {on:.2f} | {off:.2f} | {on - off:+.2f} ms |")
    on, off = (statistics.median(requests[m]) for m in MODES)
    n = len(specs(""))
    print(f"\n## {n} constrained requests, each with a new schema, {NEW_TOKENS} tokens each\n")
    print(f"- probe on: {on:.3f} s, off: {off:.3f} s (medians of {args.rounds} rounds, CPU)")
    print(f"- ratio on/off: **{on / off:.4f}** (target <= 1.05)")
    print(f"\nload average at the end: {finish_meta(meta)['load_avg_after'][0]:.2f}")


if __name__ == "__main__":
    main()
