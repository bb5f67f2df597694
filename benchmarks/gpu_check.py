"""The device check of pagedkv's GPU path (issue 24): one command, one call on a lent H200.

Sections (each timed and caught: a failing one records its error and the next one runs):

1. ``kernels``: every Triton kernel against a float64 torch reference on the device: paged
   decode (one pass and split-K), paged prefill (cached prefix, ragged batch, a decode row),
   KV write (slot -1 skipped), block copy; fp32 and bf16, block sizes 16 and 64, GQA 4, head
   dim 128; max abs error, pass at 1e-4 (fp32) / 3e-2 (bf16).
2. ``greedy``: greedy tokens of SmolLM2-135M in fp32 (8 prompts x 32 tokens): pagedkv on the
   GPU (Triton, eager and CUDA graphs) and transformers on the GPU, each against pagedkv's CPU
   path; identical sequences and the first divergence. The embedded GGUF when installed, else
   its first 6 layers from wheels/ (the whole file, 94 MiB, exceeds the device transfer).
3. ``ledger``: decode-attention time (CUDA events, median of 20, L2 cleared) and bandwidth at
   Llama-3-8B's attention shape (32/8 heads of 128, bf16) over block sizes 8-256, contexts
   1k-32k and batches 1-256, with decode_splits' split count and with one pass, beside the
   measured device-to-device copy bandwidth; block size 8 records the kernels' refusal.
4. ``engine``: a Llama-3-8B-shaped model with random bf16 weights made on the GPU; 256 Azure
   conversation requests at t = 0 (prompts <= 2048, outputs <= 256 tokens, EOS ignored):
   pagedkv's output tok/s with CUDA graphs off and on, beside transformers ``generate`` on the
   same tensors (static left-padded batches of 64, greedy, stopped after 90 s).
5. ``profile_sim``: ``pagedkv profile``'s ``measure`` (a small grid) on that model writes a
   cost profile (beside --output); the simulator replays section 4's eager run on it.

The one call on the device machine, after ``bash benchmarks/gpu_wheels.sh`` here (the device
tool's ``run`` with carry ["wheels"]; what is under $OUT comes back, even from a cut call)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \\
      --find-links wheels -r wheels/requirements.txt && export PYTHONPATH=/tmp/site:src \\
      PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_check.py --output $OUT/gpu_check.json \\
      | tee $OUT/gpu_check.md

About 5 minutes there (--deadline-s skips sections not started by 450 s). ``--dry-run``: the
same code on this CPU under Triton's interpreter at tiny sizes (a 2-layer copy of the embedded
GGUF, a tiny random llama for sections 4-5), under a minute: what keeps this script from
rotting (``tests/test_gpu_check_dry_run.py``). Both write --output (JSON, rewritten after each
section) and print a markdown summary on stdout; progress goes to stderr.
"""

from __future__ import annotations

import os
import sys

# Triton picks interpreter or compiler at its first import (transformers imports it too).
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import gpu_check_parts as parts  # noqa: E402
from common import finish_meta, machine_meta, write_json  # noqa: E402
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedkv.engine.startup import build_parts  # noqa: E402
from pagedkv.model.triton.kernels import load_kernels  # noqa: E402
from pagedkv.pages.triton_rules import block_size_problems  # noqa: E402

WHEELS = Path(__file__).resolve().parents[1] / "wheels"
SMALL_GGUF = "SmolLM2-135M-Instruct-6layers.gguf"  # what gpu_wheels.sh writes there
TRACE = "azure_llm_2023_conv.csv"
GIB = 1 << 30
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
GREEDY_TEXTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
    "List three uses of copper:", "Once upon a time, in a small village,",
    "Translate to French: good morning, my friend.", "The three laws of motion are",
    "Q: What is 17 times 23?\nA:",
]  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """Everything the device run and the dry run size differently (nothing else differs)."""

    kernel_block_sizes: tuple[int, ...]
    greedy_prompts: int
    greedy_tokens: int
    greedy_layers: int | None  # a copy of the embedded GGUF with this many layers (dry run)
    ledger_block_sizes: tuple[int, ...]
    ledger_contexts: tuple[int, ...]
    ledger_batches: tuple[int, ...]
    ledger_repeats: int
    ledger_warmup: int
    ledger_budget_s: float  # points not started by then are skipped
    ledger_pool_bytes: int  # points whose K+V pool is larger are skipped
    copy_bytes: int
    flush_bytes: int  # a buffer over the L2 size, zeroed before each timed call (0: none)
    engine_model: str  # "llama-3-8b" or "tiny"
    engine_requests: int
    max_prompt: int
    max_output: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    hf_batch: int
    hf_max_s: float  # transformers starts no batch after this much time
    profile_plan: dict = field(default_factory=dict)  # ProfilePlan's fields


DEVICE_SIZES = Sizes(
    kernel_block_sizes=(16, 64), greedy_prompts=8, greedy_tokens=32, greedy_layers=None,
    ledger_block_sizes=(8, 16, 32, 64, 128, 256), ledger_contexts=(1024, 4096, 16384, 32768),
    ledger_batches=(1, 8, 32, 128, 256), ledger_repeats=20, ledger_warmup=3,
    ledger_budget_s=90.0, ledger_pool_bytes=40 * GIB, copy_bytes=2 * GIB, flush_bytes=256 << 20,
    engine_model="llama-3-8b", engine_requests=256, max_prompt=2048, max_output=256,
    max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_bytes=40 * GIB, hf_batch=64,
    hf_max_s=90.0,
    profile_plan=dict(block_sizes=(16,), batch_sizes=(1, 8, 32, 128, 256),
                      context_lens=(256, 1024), prefill_lens=(64, 512, 2048), steps_per_point=3,
                      max_num_batched_tokens=8192),
)  # fmt: skip
DRY_SIZES = Sizes(
    kernel_block_sizes=(16,), greedy_prompts=2, greedy_tokens=4, greedy_layers=2,
    ledger_block_sizes=(8, 16), ledger_contexts=(40,), ledger_batches=(2,), ledger_repeats=2,
    ledger_warmup=1, ledger_budget_s=float("inf"), ledger_pool_bytes=GIB, copy_bytes=8 << 20,
    flush_bytes=0,
    engine_model="tiny", engine_requests=3, max_prompt=24, max_output=4, max_num_seqs=2,
    max_num_batched_tokens=64, kv_cache_bytes=8 << 20, hf_batch=2, hf_max_s=float("inf"),
    profile_plan=dict(block_sizes=(16,), batch_sizes=(1, 2), context_lens=(16,),
                      prefill_lens=(8, 32), steps_per_point=2, max_num_batched_tokens=64),
)  # fmt: skip


@dataclass
class Run:
    """What every section reads: the flags, sizes and device, and ``state`` that a later
    section takes from an earlier one (section 5 reuses section 4's model and eager run)."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    scratch: Path
    started: float
    state: dict = field(default_factory=dict)

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.started:7.1f} s] {message}", file=sys.stderr,
              flush=True)  # fmt: skip

    def free_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def attempt(errors: dict, key: str, fn, *args):
    """``fn(*args)``; when it raises, None and the error in ``errors[key]``: one failing part
    of a section (a kernel that does not compile, an engine out of memory) must not lose the
    rest of it."""
    try:
        return fn(*args)
    except Exception as exc:
        errors[key] = f"{type(exc).__name__}: {exc}"
        return None


# -- 1. kernels -----------------------------------------------------------------------------------


def check_kernels(run: Run) -> dict:
    """Each kernel against its torch reference, per dtype and block size."""
    kernels = load_kernels(run.device)
    gen = torch.Generator().manual_seed(run.args.seed)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        tolerance = TOLERANCE[dtype]
        for block_size in run.sizes.kernel_block_sizes:
            for kernel, error_of in parts.kernel_cases(kernels, block_size, dtype, run.device,
                                                       gen, run.args.dry_run):  # fmt: skip
                case = {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."),
                        "block_size": block_size, "tolerance": tolerance}  # fmt: skip
                err = attempt(case, "error", error_of)
                case.update(max_abs_error=err, ok=err is not None and err <= tolerance)
                cases.append(case)
                run.log(f"  {kernel} {case['dtype']} B={block_size}: {err}")
    q_heads, kv_heads, head_dim = parts.KERNEL_HEADS
    return {"num_q_heads": q_heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "cases": cases, "all_pass": all(c["ok"] for c in cases),
            "interpreted": kernels.interpreted}  # fmt: skip


# -- 2. greedy ------------------------------------------------------------------------------------


def check_greedy(run: Run) -> dict:
    """Greedy tokens on the device (pagedkv Triton eager and graphs, transformers) against
    pagedkv's CPU path (its C kernels), all fp32, the same prompt ids."""
    from pagedkv.model import load_model, native

    path, source = greedy_model(run)
    n, new_tokens = run.sizes.greedy_prompts, run.sizes.greedy_tokens
    loaded = load_model(path, "float32", progress=False, device=run.device)
    prompts = [loaded[2].encode(text) for text in GREEDY_TEXTS[:n]]
    tokens, errors = {}, {}
    for graphs in (False, True):
        label = "pagedkv triton" + (" + cuda graphs" if graphs else "")
        tokens[label] = attempt(errors, label, pagedkv_greedy, loaded, prompts, new_tokens,
                                "triton", graphs)  # fmt: skip
        run.log(f"  {label}: {errors.get(label, 'done')}")
    del loaded
    cpu = load_model(path, "float32", progress=False, device="cpu")
    tokens["pagedkv cpu"] = pagedkv_greedy(cpu, prompts, new_tokens, "torch", False)
    del cpu
    tokens["transformers"] = attempt(errors, "transformers", hf_greedy, path, run.device, prompts,
                                     new_tokens)  # fmt: skip
    comparisons, reference = {}, tokens["pagedkv cpu"]
    for name, seqs in tokens.items():
        if name != "pagedkv cpu" and seqs is not None:
            where = [parts.first_divergence(a, b) for a, b in zip(seqs, reference, strict=True)]
            comparisons[name] = {"identical": where.count(None), "first_divergence": where}
    return {"model": source, "prompts": n, "tokens_per_prompt": new_tokens,
            "reference": "pagedkv cpu", "comparisons": comparisons, "errors": errors,
            "cpu_c_kernels": native.unavailable_reason() or "loaded",
            "tokens": tokens}  # fmt: skip


def greedy_model(run: Run) -> tuple[Path, str]:
    """The GGUF of the greedy section and its description."""
    from pagedkv.model.embedded import embedded_model_path

    if run.args.greedy_gguf:
        return Path(run.args.greedy_gguf), run.args.greedy_gguf
    if (layers := run.sizes.greedy_layers) is not None:  # the dry run: the truncation as well
        path = parts.truncate_gguf(embedded_model_path(), run.scratch / "smollm2.gguf", layers)
        return path, f"embedded SmolLM2-135M-Instruct, first {layers} of 30 layers"
    try:
        return embedded_model_path(), "embedded SmolLM2-135M-Instruct (30 layers)"
    except FileNotFoundError:
        if not (WHEELS / SMALL_GGUF).is_file():
            raise
        return WHEELS / SMALL_GGUF, f"SmolLM2-135M-Instruct, first 6 of 30 layers ({SMALL_GGUF})"


def make_engine(loaded, dtype: str, backend: str, graphs: bool, **limits) -> LLMEngine:
    """An engine on ``loaded``'s device. CUDA graphs on the CPU (the dry run): the same
    ``DecodeGraphs``, recorded with the tests' stand-in graph."""
    device = loaded[1].device
    on_gpu = device.type == "cuda"
    config = EngineConfig(device=str(device), dtype=dtype, attention_backend=backend,
                          cuda_graphs=graphs and on_gpu, log_startup=False, **limits)  # fmt: skip
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    if graphs and not on_gpu:
        engine.parts.runner.capture_graphs(config.max_num_seqs, engine.max_model_len,
                                           parts.ReplayedGraph)  # fmt: skip
    return engine


def pagedkv_greedy(loaded, prompts, new_tokens: int, backend: str, graphs: bool):
    """pagedkv's greedy tokens of each prompt (fp32, on ``loaded``'s device)."""
    engine = make_engine(loaded, "float32", backend, graphs, max_num_seqs=len(prompts),
                         kv_cache_memory_bytes=256 << 20)  # fmt: skip
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    graphs_obj = engine.parts.runner.graphs
    if graphs and not graphs_obj.replays:  # the graphs must have run, or nothing was checked
        raise RuntimeError("no decode step ran from a CUDA graph")
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_greedy(path: Path, device: torch.device, prompts, new_tokens: int) -> list[list[int]]:
    """transformers' own GGUF loading of the same file (needs the gguf package), fp32 on
    ``device``, one prompt at a time (no padding)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model = model.to(device).eval()
    return parts.hf_generate(model, prompts, [new_tokens] * len(prompts), 1, 0, float("inf"))[3]


# -- 3. ledger ------------------------------------------------------------------------------------


def check_ledger(run: Run) -> dict:
    """Decode attention's time and bandwidth over block sizes, contexts and batches."""
    s, device = run.sizes, run.device
    kernels = load_kernels(device)
    num_q_heads, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    token_bytes = 2 * num_kv_heads * head_dim * 2  # K and V of one token, one layer, bf16
    copy_gb_s = parts.copy_bandwidth_gb_s(device, s.copy_bytes, s.ledger_repeats)
    run.log(f"  device-to-device copy: {copy_gb_s:.0f} GB/s")
    points = [(c, n, b) for c in s.ledger_contexts for n in s.ledger_batches
              for b in s.ledger_block_sizes]  # fmt: skip

    def pool_tokens(c: int, n: int, b: int) -> int:
        return n * -(-c // b) * b

    runnable = [p for p in points if not block_size_problems(p[2], head_dim)
                and pool_tokens(*p) * token_bytes <= s.ledger_pool_bytes]  # fmt: skip
    # One pool for every point (each views its first blocks): allocated and filled once.
    max_tokens = max((pool_tokens(*p) for p in runnable), default=0)
    k_flat = torch.empty(max_tokens, num_kv_heads, head_dim, dtype=dtype, device=device).normal_()
    v_flat = torch.empty_like(k_flat).normal_()
    flush = torch.empty(s.flush_bytes, dtype=torch.uint8, device=device) if s.flush_bytes else None
    rows, t0 = [], time.perf_counter()
    for c, n, b in points:
        row = {"block_size": b, "context_len": c, "batch": n}
        if problems := block_size_problems(b, head_dim):
            rows.append({**row, "refused": problems})
        elif (c, n, b) not in runnable:
            rows.append({**row, "skipped": f"pool over {s.ledger_pool_bytes / GIB:.0f} GiB"})
        elif time.perf_counter() - t0 > s.ledger_budget_s:
            rows.append({**row, "skipped": "ledger time budget spent"})
        else:
            timed = attempt(row, "error", parts.decode_times, kernels, k_flat, v_flat, c, n, b,
                            num_q_heads, s.ledger_repeats, s.ledger_warmup, flush)  # fmt: skip
            if timed is None:  # its error is in the row
                rows.append(row)
            else:
                rows += [{**row, **t, "of_copy_bw": t["gb_s"] / copy_gb_s} for t in timed]
            run.log(f"  B={b} context {c} batch {n}: {rows[-1].get('median_ms', row.get('error'))}")
    return {"shape": {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads,
                      "head_dim": head_dim, "dtype": "bfloat16"},
            "copy_gb_s": copy_gb_s, "rows": rows}  # fmt: skip


# -- 4. engine ------------------------------------------------------------------------------------


def check_engine(run: Run) -> dict:
    """pagedkv (CUDA graphs off and on) beside transformers on one trace workload."""
    s = run.sizes
    loaded, weights = engine_model(run)
    ids, outs = engine_workload(run, loaded[0].vocab_size)
    result = {"model": s.engine_model, "requests": len(ids), "prompt_tokens": sum(map(len, ids)),
              "output_tokens": sum(outs), "pagedkv": {}, "errors": {}}  # fmt: skip
    errors = result["errors"]
    for graphs in (False, True):
        label = "cuda_graphs" if graphs else "eager"
        row = attempt(errors, label, pagedkv_throughput, run, loaded, ids, outs, graphs)
        run.free_memory()
        if row is not None:
            result["pagedkv"][label] = row
        run.log(f"  pagedkv {label}: {errors.get(label) or row['tokens_per_s']} tok/s")
    hf = attempt(errors, "transformers", hf_throughput, loaded[0], weights, ids, outs, run)
    del weights
    if hf is not None:
        result["transformers"] = hf
        run.log(f"  transformers generate: {hf['tokens_per_s']:.0f} tok/s")
    rates = {k: v["tokens_per_s"] for k, v in result["pagedkv"].items()}
    if hf is not None:
        result["ratio_vs_transformers"] = {k: r / hf["tokens_per_s"] for k, r in rates.items()}
    if len(rates) == 2:
        result["cuda_graphs_speedup"] = rates["cuda_graphs"] / rates["eager"]
    return result


def engine_model(run: Run):
    """The section-4 model (random bf16 weights made on the device, a synthetic tokenizer),
    kept in ``run.state``; returns (loaded, the canonical weight tensors)."""
    from pagedkv.model.llama import build_model

    tiny = run.sizes.engine_model == "tiny"
    cfg = parts.tiny_llama_config() if tiny else parts.llama3_8b_config()
    weights = parts.random_llama_weights(cfg, run.device, torch.bfloat16, run.args.seed)
    model = build_model(cfg)
    model.load_weights(dict(weights), torch.bfloat16, None, run.device)
    loaded = (cfg, model, parts.synthetic_tokenizer(cfg.vocab_size))
    run.state["engine_loaded"] = loaded
    return loaded, weights


def engine_workload(run: Run, vocab_size: int):
    from pagedkv.traces import shared_trace

    path = run.args.trace or shared_trace(TRACE) or WHEELS / "traces" / TRACE
    count = run.args.engine_requests or run.sizes.engine_requests
    return parts.trace_workload(path, count, vocab_size, run.sizes.max_prompt,
                                run.sizes.max_output, run.args.seed)  # fmt: skip


def pagedkv_throughput(run: Run, loaded, ids, outs, graphs: bool) -> dict:
    """One timed ``generate`` of the whole workload on a fresh engine (after a warm-up that
    compiles the kernels); the eager run is kept in ``run.state`` for section 5."""
    s = run.sizes
    engine = make_engine(loaded, "bfloat16", "triton", graphs, max_num_seqs=s.max_num_seqs,
                         max_num_batched_tokens=s.max_num_batched_tokens,
                         max_model_len=s.max_prompt + s.max_output + 16,
                         kv_cache_memory_bytes=s.kv_cache_bytes)  # fmt: skip
    engine.generate([list(range(300, 316))] * 2, SamplingParams(max_tokens=4, ignore_eos=True))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in outs]
    graphs_obj = engine.parts.runner.graphs
    steps_before, replays_before = engine.stats().num_steps, graphs_obj.replays if graphs else 0
    t0 = time.perf_counter()
    results = engine.generate(ids, params)
    seconds = time.perf_counter() - t0
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    stats = engine.stats()
    row = {"tokens_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated,
           "steps": stats.num_steps - steps_before, "preemptions": stats.preemptions,
           "peak_running": stats.peak_running, "num_blocks": engine.info.num_blocks,
           "graph_replays": graphs_obj.replays - replays_before if graphs else 0}  # fmt: skip
    if not graphs:
        run.state["engine_run"] = {"seconds": seconds, "config": engine.config, "ids": ids,
                                   "outs": outs, "num_blocks": engine.info.num_blocks,
                                   "block_size": engine.info.block_size,
                                   "max_model_len": engine.max_model_len, "row": row}  # fmt: skip
    return row


def hf_throughput(cfg, weights, ids, outs, run: Run) -> dict:
    """transformers ``generate`` on a LlamaForCausalLM holding the same weight tensors."""
    s = run.sizes
    model = parts.hf_llama(cfg, weights, run.device, torch.bfloat16)
    seconds, useful, done, _ = parts.hf_generate(model, ids, outs, s.hf_batch, 0, s.hf_max_s)
    return {
        "tokens_per_s": useful / seconds,
        "seconds": seconds,
        "useful_tokens": useful,
        "requests_run": done,
        "batch_size": s.hf_batch,
    }


# -- 5. profile + simulator -----------------------------------------------------------------------


def check_profile_sim(run: Run) -> dict:
    """Fit a cost profile on the engine model, predict section 4's eager run with it."""
    from pagedkv.commands.profile import measure
    from pagedkv.engine.profiling import ProfilePlan
    from pagedkv.kvcache.policies import get_policy
    from pagedkv.sched import SchedulerConfig
    from pagedkv.sim.profiled_cost import read_cost_profile
    from pagedkv.sim.simulator import Simulation
    from pagedkv.traces import FreshSegments, TraceRequest

    loaded = run.state.get("engine_loaded") or engine_model(run)[0]
    if "engine_run" not in run.state:  # section 4 did not run it: measure it here
        pagedkv_throughput(run, loaded, *engine_workload(run, loaded[0].vocab_size), False)
    measured = run.state["engine_run"]
    base = EngineConfig(device=str(loaded[1].device), dtype="bfloat16",
                        attention_backend="triton", log_startup=False)  # fmt: skip
    profile = measure(base, ProfilePlan(**run.sizes.profile_plan), None, run.args.seed, False,
                      "wall", loaded)  # fmt: skip
    path = Path(run.args.output).with_suffix(".cost_profile.json")
    profile.write(path)  # what `pagedkv simulate --cost-profile` reads, read back the same way
    config, fresh = measured["config"], FreshSegments()
    requests = [TraceRequest(0.0, fresh.take(len(p)), n)
                for p, n in zip(measured["ids"], measured["outs"], strict=True)]  # fmt: skip
    scheduler = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=config.max_num_batched_tokens,
                                max_model_len=measured["max_model_len"],
                                preemption=config.preemption)  # fmt: skip
    # The engine's usable blocks + the null block, as build_parts gives its allocator.
    slots = (measured["num_blocks"] + 1) * measured["block_size"]
    sim = Simulation(requests, get_policy(config.policy), slots, scheduler,
                     read_cost_profile(path).cost_model()).run()  # fmt: skip
    return {"profile_path": str(path), "profile": profile.describe(),
            "fit_rms_rel_error": profile.fit.rms_rel_error, "fit_samples": profile.fit.num_samples,
            "measured_s": measured["seconds"], "predicted_s": sim.duration_s,
            "rel_error": sim.duration_s / measured["seconds"] - 1,
            "steps": {"engine": measured["row"]["steps"], "simulator": sim.num_steps},
            "preemptions": {"engine": measured["row"]["preemptions"],
                            "simulator": sim.preemptions}}  # fmt: skip


SECTIONS = {"kernels": check_kernels, "greedy": check_greedy, "ledger": check_ledger,
            "engine": check_engine, "profile_sim": check_profile_sim}  # fmt: skip


# -- the run --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU under Triton's interpreter, tiny sizes (the test's run)")  # fmt: skip
    p.add_argument("--output", default="results/gpu_check.json", help="JSON (%(default)s)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated, run in the order given (default: %(default)s)")  # fmt: skip
    p.add_argument("--trace", help=f"Azure conversation CSV (default: the shared {TRACE}, "
                   "else wheels/traces/, which gpu_wheels.sh fills)")  # fmt: skip
    p.add_argument("--greedy-gguf", help="the greedy section's GGUF (default: the embedded "
                   f"model, else wheels/{SMALL_GGUF})")  # fmt: skip
    p.add_argument("--engine-requests", type=int, help="section 4's requests (device: 256)")
    p.add_argument("--deadline-s", type=float, default=450.0,
                   help="sections not started by then are skipped (%(default)s s)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if unknown := set(args.sections.split(",")) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args


def run_section(name: str, run: Run, results: dict) -> None:
    """One section, timed; an exception is recorded (message and traceback) and swallowed."""
    run.log(f"section {name}: start")
    t0 = time.perf_counter()
    entry: dict = {"ok": False, "error": None}
    try:
        entry["result"] = SECTIONS[name](run)
        entry["ok"] = True
    except Exception as exc:  # one failing section must not lose the others
        entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["traceback"] = traceback.format_exc()
        run.log(f"section {name}: FAILED {entry['error']}")
    run.free_memory()
    entry["wall_s"] = round(time.perf_counter() - t0, 2)
    results["sections"][name] = entry
    run.log(f"section {name}: {entry['wall_s']} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (--dry-run runs on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    started = time.perf_counter()
    results = {"meta": machine_meta(
        dry_run=args.dry_run, argv=sys.argv[1:], versions=parts.versions(),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        # The interpreter's bf16 dot multiplies raw bits: widened, as the tests' fixture does.
        interpreter_bf16_dot_patch=args.dry_run and parts.patch_interpreter_bf16_dot(),
    ), "sections": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        run = Run(args, DRY_SIZES if args.dry_run else DEVICE_SIZES, device, Path(scratch),
                  started)  # fmt: skip
        for name in args.sections.split(","):
            if time.perf_counter() - started > args.deadline_s:
                results["sections"][name] = {"ok": False, "wall_s": 0.0,
                                             "error": "skipped: --deadline-s passed"}  # fmt: skip
            else:
                run_section(name, run, results)
            write_json(args.output, results)  # after every section: a cut call keeps the rest
        run.state.clear()
    finish_meta(results["meta"])
    results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(args.output, results)
    print(parts.summary_markdown(results))
    run.log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
