"""The device check's last section, ``clock``: fit the clock of pagedkv's own engine from the
check's own sections and report the simulator's error on the check's own engine runs, so every
device run re-validates the clock (issue 47; ``pagedkv calibrate --from-gpu-check`` is the same
fit on the written JSON).

What it measures first (what the earlier sections lack for the fit and its check):

1. ``graph_steps``: ``pagedkv profile``'s grid on an engine with CUDA graphs, at other contexts
   and prompt lengths than the profile_sim section's (decode batches of 1-256 at ~384 and
   ~1,024 tokens, prompts of 256, 1,024 and 1,536): its decode steps are graph replays (the
   host cost with graphs), its prefill and mixed steps more eager steps (``eager_steps``);
2. ``warm_runs``: the engine section's workload again, eager and with graphs, on a warm
   process, every step timed (shape and seconds): the runs' own step timeline, and by
   difference with the engine section's seconds what a first run pays once (kernel compiles);
3. ``workload`` and ``model_shape``: how the engine section ran, so the fit needs no outside
   table;
4. ``host_steps``: the engine section's workload again (and its requests with prompts cut to
   256 tokens: narrow block tables) on an eager engine whose model's forward is removed
   (``NoForward``): every step's host work alone (schedule, inputs and their copies, sampling
   over zero logits, outputs), with its longest context; the clock's host terms (per step,
   sequence, block-table entry, new token) are fitted to them, apart from the GPU (the H200
   check's eager steps could not tell the host's per-step cost from the launches);
5. ``compiles``: every Triton compile of the process (a new specialisation: a kernel's
   integer arguments are specialised on == 1 and on % 16, e.g. the block table's width),
   timed, with the part of the check that ran it (``CompileLog``, installed when this module
   is imported, before any section runs): what the engine section's timed runs paid to
   compile, which a clock of a warm engine does not price. The warm runs' steps carry their
   longest context and their compiles too.

Then ``sim.engine_calibrate.calibrate_engine`` on the JSON so far plus these, and: the fitted
clock (also written beside --output as ``<output>.clock.json``), each decode law's ledger
errors, the step fit, the engine section's runs and the warm runs replayed on the clock, and
the clock's error on the warm runs' own steps. The dry run does all of it on the CPU (priced as an
H200, numbers without meaning), which is what keeps the path from rotting.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from gpu_check_engine import engine_model, engine_workload, make_engine
from gpu_check_run import TRACE, WHEELS, Run, attempt
from pagedkv.engine import EngineConfig, SamplingParams

# The graph grid (ProfilePlan's fields), device run and dry run. Its pool holds the largest
# batch at the longest sequence: 256 x ~2,100 tokens x 128 KiB = 71 GB for Llama-3-8B, as the
# profile_sim section's (a prefill length over 2,048 would size it past the card).
GRAPH_PLAN = dict(block_sizes=(16,), batch_sizes=(1, 8, 32, 128, 256), context_lens=(384, 1024),
                  prefill_lens=(256, 1024, 1536), steps_per_point=3,
                  max_num_batched_tokens=8192)  # fmt: skip
DRY_GRAPH_PLAN = dict(block_sizes=(16,), batch_sizes=(1, 2), context_lens=(24,),
                      prefill_lens=(16,), steps_per_point=2, max_num_batched_tokens=64)  # fmt: skip
DRY_GPU = "H200-141GB"  # the CPU is no GPU preset: the dry run prices as this one
DRY_NOTE = "dry run: CPU timings priced as an H200"


HOST_SHORT_PROMPT = 256  # the second host-only replay's prompt cap: narrow block tables
# The check's functions whose frames say who compiled a kernel (innermost first), and a label.
COMPILE_PHASES = (("_host_run", "clock: host-only replay"), ("_timed_run", "clock: warm run"),
                  ("_graph_steps", "clock: graph grid"), ("capture", "graph capture"),
                  ("pagedkv_throughput", "engine section"),
                  ("batch1_latency", "engine section: batch 1"),
                  ("check_profile_sim", "profile_sim section"),
                  ("check_ledger", "ledger section"), ("check_kernels", "kernels section"),
                  ("check_greedy", "greedy section"), ("check_service", "service section"))  # fmt: skip


class CompileLog:
    """Every Triton JIT compile of this process (a kernel's first call with a new
    specialisation), timed through Triton's compile hooks, with the part of the check that
    ran it. In the engine section, "timed run" means the compile fell inside the timed
    ``generate`` (its local ``t0`` was set), "warm-up" before it. No events under Triton's
    interpreter (nothing compiles) or a Triton without the hooks (``installed`` False)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.installed = False
        self._started = 0.0

    def hook_pair(self, before=None, after=None):
        """(Triton's ``jit_cache_hook``, ``jit_post_compile_hook``): the first called before a
        compile, the second after it; ``before``/``after``: hooks already installed, still
        called."""

        def starting(**kw):
            self._started = time.perf_counter()
            return before(**kw) if before else None  # a true value would skip the compile

        def done(**kw):
            fn = kw.get("fn")
            self.events.append({"kernel": getattr(fn, "name", "?"), "during": _phase(),
                                "seconds": time.perf_counter() - self._started,
                                "at": self._started})  # fmt: skip
            return after(**kw) if after else None

        return starting, done

    def install(self) -> None:
        try:
            from triton import knobs
        except Exception:  # no triton, or one without knobs: nothing recorded, and said so
            return
        rt = knobs.runtime
        rt.jit_cache_hook, rt.jit_post_compile_hook = self.hook_pair(
            rt.jit_cache_hook, rt.jit_post_compile_hook
        )
        self.installed = True

    def count_since(self, t: float) -> tuple[int, float]:
        """(compiles, their seconds) that started at or after perf_counter time ``t``."""
        mine = [e for e in self.events if e["at"] >= t]
        return len(mine), sum(e["seconds"] for e in mine)

    def summary(self, started: float) -> dict:
        """Per phase: count and seconds; every event with its time since ``started``."""
        phases: dict[str, dict] = {}
        for e in self.events:
            p = phases.setdefault(e["during"], {"compiles": 0, "seconds": 0.0})
            p["compiles"] += 1
            p["seconds"] += e["seconds"]
        events = [{**{k: v for k, v in e.items() if k != "at"}, "at_s": e["at"] - started}
                  for e in self.events]  # fmt: skip
        return {"hooks_installed": self.installed, "by_phase": phases, "events": events}


def _phase() -> str:
    """The check's part on the stack (``COMPILE_PHASES``), innermost first."""
    frame = sys._getframe(1)
    names = dict(COMPILE_PHASES)
    while frame is not None:
        label = names.get(frame.f_code.co_name)
        if label == "engine section":
            mode = "cuda_graphs" if frame.f_locals.get("graphs") else "eager"
            mode += "_async" if frame.f_locals.get("ahead") else ""
            return f"engine section {mode} " + ("timed run" if "t0" in frame.f_locals
                                                else "warm-up")  # fmt: skip
        if label is not None:
            return label
        frame = frame.f_back
    return "elsewhere"


# Installed on import: gpu_check.py imports this module before any section runs, and the
# engine section's compiles are what the clock section must report.
COMPILES = CompileLog()
COMPILES.install()


class NoForward:
    """The model with its forward removed: zero hidden states and zero fp32 logits of the
    shapes the runner expects, on the model's device (the ids still cross to it), so an
    engine step pays its host work alone; every other attribute is the model's."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, *args, **kwargs):
        m = self._model
        input_ids.to(m.device, non_blocking=True)
        positions.to(m.device, non_blocking=True)
        return torch.zeros(input_ids.shape[0], m.config.hidden_size, device=m.device,
                           dtype=m.dtype)  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        m = self._model
        return torch.zeros(hidden.shape[0], m.config.vocab_size, device=m.device,
                           dtype=torch.float32)  # fmt: skip


def _step_record(step, longest: int | None = None) -> dict:
    record = {**asdict(step.shape), "seconds": step.seconds}
    if longest is not None:
        record["max_context_tokens"] = longest
    return record


def _observe_longest(engine) -> list[int]:
    """A one-item list the engine's scheduler keeps at the longest context of the batch it
    last scheduled (a wrapper like StepRecorder's: it decides nothing)."""
    scheduler, longest = engine.scheduler, [0]
    schedule = scheduler.schedule

    def observed():
        batch = schedule()
        longest[0] = max((i.num_computed_tokens + i.num_new_tokens for i in batch.seqs), default=0)
        return batch

    scheduler.schedule = observed
    return longest


def _graph_steps(run: Run, loaded) -> tuple[list[dict], list[dict]]:
    """(graph-replayed decode steps, eager prefill/mixed steps) of the graph grid."""
    from pagedkv.engine.profiling import ProfilePlan, profile_engine

    plan = ProfilePlan(**(DRY_GRAPH_PLAN if run.args.dry_run else GRAPH_PLAN))
    # The CPU runs no CUDA graph (the dry run's "graph" steps are eager: the path is what it tests)
    on_gpu = loaded[1].device.type == "cuda"
    base = EngineConfig(device=str(loaded[1].device), dtype="bfloat16", attention_backend="triton",
                        cuda_graphs=on_gpu, log_startup=False)  # fmt: skip
    samples = profile_engine(loaded, base, plan, None, run.args.seed, "wall")
    decode = [s for s in samples if s.shape.num_decode_seqs == s.shape.num_seqs]
    other = [s for s in samples if s.shape.num_decode_seqs != s.shape.num_seqs]
    return [_step_record(s) for s in decode], [_step_record(s) for s in other]


def _timed_run(run: Run, loaded, ids, outs, graphs: bool) -> dict:
    """Section 4's workload on a fresh engine of its limits (warm process), each step timed."""
    from pagedkv.engine.profiling import StepRecorder

    s = run.sizes
    engine = make_engine(loaded, "bfloat16", "triton", graphs, False, max_num_seqs=s.max_num_seqs,
                         max_num_batched_tokens=s.max_num_batched_tokens,
                         max_model_len=s.max_prompt + s.max_output + 16,
                         kv_cache_memory_bytes=s.kv_cache_bytes)  # fmt: skip
    engine.generate([list(range(300, 316))] * 2, SamplingParams(max_tokens=4, ignore_eos=True))
    rec, steps = StepRecorder(engine), []
    longest = _observe_longest(engine)
    t0 = time.perf_counter()
    for prompt, n in zip(ids, outs, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        started = time.perf_counter()
        rec.step()
        if rec.last is not None:
            count, secs = COMPILES.count_since(started)
            steps.append({**_step_record(rec.last, longest[0]),
                          **({"compiles": count, "compile_s": secs} if count else {})})  # fmt: skip
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "num_steps": len(steps), "steps": steps,
            "compiles": COMPILES.count_since(t0)[0]}  # fmt: skip


def _host_run(run: Run, loaded, ids, outs) -> list[dict]:
    """Section 4's workload on an eager engine of its limits whose model has no forward
    (``NoForward``): every step timed with its shape and longest context."""
    from pagedkv.engine.profiling import StepRecorder

    s = run.sizes
    engine = make_engine(loaded, "bfloat16", "triton", False, False, max_num_seqs=s.max_num_seqs,
                         max_num_batched_tokens=s.max_num_batched_tokens,
                         max_model_len=s.max_prompt + s.max_output + 16,
                         kv_cache_memory_bytes=s.kv_cache_bytes)  # fmt: skip
    engine.parts.runner.model = NoForward(engine.parts.runner.model)
    engine.generate([list(range(300, 316))] * 2, SamplingParams(max_tokens=4, ignore_eos=True))
    rec, steps = StepRecorder(engine), []
    longest = _observe_longest(engine)
    for prompt, n in zip(ids, outs, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        rec.step()
        if rec.last is not None:
            steps.append(_step_record(rec.last, longest[0]))
    return steps


def _workload(run: Run, measured: dict, ids, outs, trace: Path) -> dict:
    s = run.sizes
    return {"trace": trace.name, "requests": len(ids), "max_prompt": s.max_prompt,
            "max_output": s.max_output, "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "max_model_len": measured["max_model_len"], "block_size": measured["block_size"],
            "num_blocks": measured["num_blocks"], "policy": measured["config"].policy,
            "prompt_tokens": sum(map(len, ids)), "output_tokens": sum(outs)}  # fmt: skip


def _model_shape(name: str, cfg) -> dict:
    from pagedkv.pages.sources import estimate_dense_num_params

    params = estimate_dense_num_params({
        "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers, "tie_word_embeddings": cfg.tie_word_embeddings,
    })  # fmt: skip
    return {"name": name, "architecture": "LlamaForCausalLM",
            "attention": "mha", "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_params": params}  # fmt: skip


def _trace_path(run: Run) -> Path:
    from pagedkv.traces import shared_trace

    return Path(run.args.trace or shared_trace(TRACE) or WHEELS / "traces" / TRACE)


def check_clock(run: Run) -> dict:
    """Measure (module docstring), fit the clock on the check so far plus this section's
    steps, and replay the engine section's runs and the warm runs on it."""
    from pagedkv.sim.pagedkv_triton.calibrate import calibrate_engine
    from pagedkv.sim.pagedkv_triton.check import check_runs, workload_requests
    from pagedkv.sim.pagedkv_triton.check_records import timed_steps
    from pagedkv.sim.pagedkv_triton.clock import clock_to_dict, write_engine_clock
    from pagedkv.sim.pagedkv_triton.cost import EngineCostModel
    from pagedkv.sim.pagedkv_triton.fit import step_report

    loaded = run.state.get("engine_loaded") or engine_model(run)[0]
    ids, outs = engine_workload(run, loaded[0].vocab_size)
    if "engine_run" not in run.state:  # the engine section did not run: its eager run here
        from gpu_check_engine import pagedkv_throughput

        pagedkv_throughput(run, loaded, ids, outs, False)
    measured = run.state["engine_run"]
    run.log("  graph grid: decode steps replayed from CUDA graphs, more prefill and mixed steps")
    graph_steps, eager_steps = _graph_steps(run, loaded)
    run.free_memory()
    warm = {}
    for graphs in (False, True):
        label = "cuda_graphs" if graphs else "eager"
        warm[label] = _timed_run(run, loaded, ids, outs, graphs)
        run.free_memory()
        run.log(
            f"  warm {label} run: {warm[label]['seconds']:.2f} s, {warm[label]['num_steps']} steps"
        )
    host_steps = _host_run(run, loaded, ids, outs)
    host_steps += _host_run(run, loaded, [p[:HOST_SHORT_PROMPT] for p in ids], outs)
    run.free_memory()
    run.log(f"  host-only replays: {len(host_steps)} steps, "
            f"{sum(h['seconds'] for h in host_steps):.2f} s")  # fmt: skip
    trace = _trace_path(run)
    result = {"graph_steps": graph_steps, "eager_steps": eager_steps, "host_steps": host_steps,
              "warm_runs": warm, "workload": _workload(run, measured, ids, outs, trace),
              "model_shape": _model_shape(run.sizes.engine_model, loaded[0]),
              "compiles": COMPILES.summary(run.started)}  # fmt: skip
    output = Path(run.args.output)
    gpu = DRY_GPU if run.args.dry_run else None
    errors: dict = {}
    fitted = attempt(
        errors,
        "fit_error",
        lambda: calibrate_engine(
            output, gpu, trace, progress=run.log, sections={"clock": {"ok": True, "result": result}}
        ),
    )
    if fitted is None:  # the measurements above are the device time: keep them for a refit
        run.log(f"  clock fit failed: {errors['fit_error']}")
        return {**result, **errors}
    clock_path = output.with_suffix(".clock.json")
    write_engine_clock(clock_path, fitted.clock, fitted.meta)
    data, model, clock = fitted.data, fitted.model, fitted.clock
    w = data.workload
    assert w is not None  # this section wrote it
    requests = workload_requests(w, trace)
    costs = {m: EngineCostModel(model, data.gpu, clock, cuda_graphs=m == "cuda_graphs")
             for m in ("eager", "cuda_graphs")}  # fmt: skip
    warm_check = check_runs(w, requests, {k: v["seconds"] for k, v in warm.items()},
                            {k: v["num_steps"] for k, v in warm.items()}, costs)  # fmt: skip
    warm_steps = {k: step_report(clock, model, data.gpu,
                                 timed_steps(v["steps"], f"warm_runs.{k}"), k == "cuda_graphs")
                  for k, v in warm.items()}  # fmt: skip
    result.update(clock_path=str(clock_path), clock=clock_to_dict(clock, {}),
                  gpu=data.gpu.name, decode_laws=fitted.meta["decode_laws"],
                  steps=fitted.meta["steps"], runs=fitted.meta["runs"], warm_check=warm_check,
                  warm_steps=warm_steps,
                  dry_run_note=DRY_NOTE if gpu else None)  # fmt: skip
    return result


def clock_markdown(r: dict) -> list[str]:
    """The section as markdown: the laws, the step fit, the runs replayed, where each part of
    the clock comes from."""

    def pct(v) -> str:
        return "-" if v is None else f"{v:+.1%}"

    if "fit_error" in r:
        return [
            f"the clock's fit failed: {r['fit_error']}; its measurements are in the JSON "
            f"({len(r['graph_steps'])} graph steps, {len(r['eager_steps'])} eager steps, "
            f"{len(r['host_steps'])} host-only steps, warm runs "
            f"{', '.join(r['warm_runs'])}): refit with `pagedkv calibrate --from-gpu-check`"
        ]
    out = [f"clock of pagedkv's engine on {r['gpu']} written to {r['clock_path']}"
           + (f" ({r['dry_run_note']})" if r.get("dry_run_note") else ""), "",
           "| decode law | median | p90 | max | leave-one-context-out median |",
           "|---|---|---|---|---|"]  # fmt: skip
    chosen = r["clock"]["params"]["decode_law"]
    for s in r["decode_laws"]:
        mark = " (chosen)" if s["law"] == chosen else ""
        out.append(f"| {s['law']}{mark} | {s['median_err']:.1%} | {s['p90_err']:.1%} | "
                   f"{s['max_err']:.1%} | {pct(s['loco_median_err'])} |")  # fmt: skip
    out += ["", "| steps | kind | count | median error | max |", "|---|---|---|---|---|"]
    for title, reports in (("fit", r["steps"]), ("warm run", r["warm_steps"])):
        for mode, report in reports.items():
            for kind, s in report.items():
                if kind != "sum_rel_err":
                    out.append(f"| {title} {mode} | {kind} | {s['steps']} | "
                               f"{s['median_rel_err']:.1%} | {s['max_rel_err']:.1%} |")  # fmt: skip
            out.append(f"| {title} {mode} | sum | | {pct(report['sum_rel_err'])} | |")
    out += ["", "| run | measured s | simulated s | error | steps engine / sim |",
            "|---|---|---|---|---|"]  # fmt: skip
    for title, runs in (("engine section", r["runs"]), ("warm", r["warm_check"])):
        if "skipped" in runs:
            out.append(f"| {title} | skipped: {runs['skipped']} | | | |")
            continue
        for mode, c in runs.items():
            steps = f"{c['steps']['engine']} / {c['steps']['simulator']}"
            out.append(f"| {title} {mode} | {c['measured_s']:.2f} | {c['predicted_s']:.2f} | "
                       f"{pct(c['rel_err'])} | {steps} |")  # fmt: skip
    out += [""] + [f"- {part}: {src}" for part, src in r["clock"]["sources"].items()]
    compiles = r.get("compiles", {})
    if not compiles.get("hooks_installed"):
        out.append("- Triton compiles: not recorded (no compile hooks in this Triton, or none "
                   "ran: the interpreter)")  # fmt: skip
    else:
        out += ["", "| Triton compiles during | count | seconds |", "|---|---|---|"]
        out += [f"| {phase} | {c['compiles']} | {c['seconds']:.2f} |"
                for phase, c in compiles.get("by_phase", {}).items()]  # fmt: skip
    return out
