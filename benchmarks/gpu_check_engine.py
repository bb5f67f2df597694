"""The greedy and engine sections' helpers: the greedy prompts, the models (the GGUF the greedy
section reads, the engine section's random-weight model and trace workload), engines on the
device (CUDA graphs replayed with a stand-in on the CPU), pagedkv's and transformers' greedy
tokens and throughput runs, and where two token lists first differ."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gpu_check_gguf import truncate_gguf
from gpu_check_models import (
    ReplayedGraph,
    hf_generate,
    hf_llama,
    llama3_8b_config,
    random_llama_weights,
    synthetic_tokenizer,
    tiny_llama_config,
    trace_workload,
)
from gpu_check_run import SMALL_GGUF, TRACE, WHEELS, Run
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.engine.step.timeline import StepTimeline, summarize

# -- 2. greedy ------------------------------------------------------------------------------------

GREEDY_TEXTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
    "List three uses of copper:", "Once upon a time, in a small village,",
    "Translate to French: good morning, my friend.", "The three laws of motion are",
    "Q: What is 17 times 23?\nA:",
]  # fmt: skip


def greedy_model(run: Run) -> tuple[Path, str]:
    """The GGUF of the greedy section and its description."""
    from pagedkv.model.embedded import embedded_model_path

    if run.args.greedy_gguf:
        return Path(run.args.greedy_gguf), run.args.greedy_gguf
    if (layers := run.sizes.greedy_layers) is not None:  # the dry run: the truncation as well
        path = truncate_gguf(embedded_model_path(), run.scratch / "smollm2.gguf", layers)
        return path, f"embedded SmolLM2-135M-Instruct, first {layers} of 30 layers"
    try:
        return embedded_model_path(), "embedded SmolLM2-135M-Instruct (30 layers)"
    except FileNotFoundError:
        if not (WHEELS / SMALL_GGUF).is_file():
            raise
        return WHEELS / SMALL_GGUF, f"SmolLM2-135M-Instruct, first 6 of 30 layers ({SMALL_GGUF})"


def make_engine(loaded, dtype: str, backend: str, graphs: bool, ahead: bool | None = None,
                **limits) -> LLMEngine:  # fmt: skip
    """An engine on ``loaded``'s device; ``ahead``: scheduling one step ahead (None: the
    engine's default, on on a GPU). CUDA graphs on the CPU (the dry run): the same
    ``DecodeGraphs``, recorded with the tests' stand-in graph."""
    device = loaded[1].device
    on_gpu = device.type == "cuda"
    config = EngineConfig(device=str(device), dtype=dtype, attention_backend=backend,
                          cuda_graphs=graphs and on_gpu, async_scheduling=ahead,
                          log_startup=False, **limits)  # fmt: skip
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    if graphs and not on_gpu:
        engine.parts.runner.capture_graphs(config.max_num_seqs, engine.max_model_len,
                                           ReplayedGraph)  # fmt: skip
    return engine


def pagedkv_greedy(loaded, prompts, new_tokens: int, backend: str, graphs: bool,
                   ahead: bool = False):  # fmt: skip
    """pagedkv's greedy tokens of each prompt (fp32, on ``loaded``'s device)."""
    engine = make_engine(loaded, "float32", backend, graphs, ahead, max_num_seqs=len(prompts),
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
    return hf_generate(model, prompts, [new_tokens] * len(prompts), 1, 0, float("inf"))[3]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- 4. engine ------------------------------------------------------------------------------------


def engine_model(run: Run):
    """The section-4 model (random bf16 weights made on the device, a synthetic tokenizer),
    kept in ``run.state``; returns (loaded, the canonical weight tensors)."""
    from pagedkv.model.llama import build_model

    tiny = run.sizes.engine_model == "tiny"
    cfg = tiny_llama_config() if tiny else llama3_8b_config()
    weights = random_llama_weights(cfg, run.device, torch.bfloat16, run.args.seed)
    model = build_model(cfg)
    model.load_weights(dict(weights), torch.bfloat16, None, run.device)
    loaded = (cfg, model, synthetic_tokenizer(cfg.vocab_size))
    run.state["engine_loaded"] = loaded
    return loaded, weights


def engine_workload(run: Run, vocab_size: int):
    from pagedkv.traces import shared_trace

    path = run.args.trace or shared_trace(TRACE) or WHEELS / "traces" / TRACE
    count = run.args.engine_requests or run.sizes.engine_requests
    return trace_workload(path, count, vocab_size, run.sizes.max_prompt,
                          run.sizes.max_output, run.args.seed)  # fmt: skip


# The engine section's runs: (CUDA graphs, scheduling one step ahead). "eager" and
# "cuda_graphs" step synchronously, as the H200 check of issue 24 ran them (the clock section
# and profile_sim model those); "cuda_graphs_async" is the GPU's default engine.
ENGINE_RUNS = {"eager": (False, False), "cuda_graphs": (True, False),
               "cuda_graphs_async": (True, True)}  # fmt: skip


def warm_up(engine: LLMEngine, max_prompt: int) -> None:
    """Compile what the timed run will call before it is timed: prompts whose lengths differ
    by parity and by 16 (Triton specialises integer arguments on == 1 and % 16), a prefill
    step, a mixed step (decode rows beside a new prompt) and decode steps of several sizes."""
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    lengths = sorted({min(n, max_prompt) for n in (16, 17, 100, 777, max_prompt)})
    engine.add_request(list(range(300, 300 + lengths[0])), greedy)
    engine.step()  # the first prompt's prefill: the next ones arrive beside a decode row
    for n in lengths[1:]:
        engine.add_request([300 + i % 16 for i in range(n)], greedy)
    while engine.has_unfinished():
        engine.step()


def pagedkv_throughput(run: Run, loaded, ids, outs, graphs: bool, ahead: bool = False) -> dict:
    """One timed ``generate`` of the whole workload on a fresh engine (after a warm-up that
    compiles the kernels), every step's phases in a ``StepTimeline`` (its summary per kind of
    step in the row); the synchronous eager run is kept in ``run.state`` for the later
    sections."""
    s = run.sizes
    engine = make_engine(loaded, "bfloat16", "triton", graphs, ahead,
                         max_num_seqs=s.max_num_seqs,
                         max_num_batched_tokens=s.max_num_batched_tokens,
                         max_model_len=s.max_prompt + s.max_output + 16,
                         kv_cache_memory_bytes=s.kv_cache_bytes)  # fmt: skip
    warm_up(engine, s.max_prompt)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in outs]
    graphs_obj = engine.parts.runner.graphs
    steps_before, replays_before = engine.stats().num_steps, graphs_obj.replays if graphs else 0
    timeline = StepTimeline(loaded[1].device)
    engine.attach_timeline(timeline)
    t0 = time.perf_counter()
    results = engine.generate(ids, params)
    seconds = time.perf_counter() - t0
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    stats = engine.stats()
    row = {"tokens_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated,
           "steps": stats.num_steps - steps_before, "preemptions": stats.preemptions,
           "peak_running": stats.peak_running, "num_blocks": engine.info.num_blocks,
           "graph_replays": graphs_obj.replays - replays_before if graphs else 0,
           "async_scheduling": engine.steps_ahead,
           "timeline": summarize(timeline.records()),
           "_tokens": [list(r.outputs[0].token_ids) for r in results]}  # fmt: skip
    if not graphs and not ahead:
        run.state["engine_run"] = {"seconds": seconds, "config": engine.config, "ids": ids,
                                   "outs": outs, "num_blocks": engine.info.num_blocks,
                                   "block_size": engine.info.block_size,
                                   "max_model_len": engine.max_model_len, "row": row}  # fmt: skip
    return row


def default_pool(run: Run, loaded) -> dict:
    """An engine with default settings on the section's model (on a GPU its pool is sized from
    the card: --gpu-memory-utilization 0.9): the pool's size and the start-up lines saying
    how it was sized. The engine is dropped before the next section. CUDA graphs off: they are
    captured after the pool is sized, so they change nothing here but the time it takes."""
    s = run.sizes
    config = EngineConfig(device=str(loaded[1].device), log_startup=False, cuda_graphs=False,
                          max_num_seqs=s.max_num_seqs,
                          max_num_batched_tokens=s.max_num_batched_tokens)  # fmt: skip
    parts = build_parts(config, loaded)
    info = LLMEngine(config, parts=parts).info
    lines = [ln for ln in parts.startup_report.splitlines() if "KV pool" in ln]
    return {"kv_cache_bytes": info.kv_cache_bytes, "kv_cache_gib": info.kv_cache_bytes / 2**30,
            "num_blocks": info.num_blocks, "block_size": info.block_size,
            "max_model_len": info.max_model_len, "startup": lines}  # fmt: skip


def hf_throughput(cfg, weights, ids, outs, run: Run) -> dict:
    """transformers ``generate`` on a LlamaForCausalLM holding the same weight tensors."""
    s = run.sizes
    model = hf_llama(cfg, weights, run.device, torch.bfloat16)
    seconds, useful, done, _ = hf_generate(model, ids, outs, s.hf_batch, 0, s.hf_max_s)
    return {
        "tokens_per_s": useful / seconds,
        "seconds": seconds,
        "useful_tokens": useful,
        "requests_run": done,
        "batch_size": s.hf_batch,
    }
