"""What the benchmarks share: the timer and the alternating loop, medians and ratios, the
machine a run measured, and the result file.

Every script in ``benchmarks/`` compares pagedkv with a peer (or with itself another way) in one
process, and they all follow the same rules, written once here:

* **Alternate, flipping the order.** Round ``r`` runs the sides in their given order when ``r``
  is even and reversed when it is odd (``round_order``), so a slow moment of the machine, warm
  caches or a collection triggered by the previous side's garbage falls on each side as often
  first as second. Scripts that used a fixed order (ours, peer, ours, peer ...) now flip too.
* **Medians of the repeats**, and ratios as ``values[base] / values[name]`` (``ratios``).
* **The machine beside the numbers** (``machine_meta`` at the start, ``finish_meta`` at the
  end): CPU model and cores, load averages before and after, Python and torch versions, the git
  commit: a result file then says what measured it and how busy the machine was.
* **Result files** (``write_json``): parent folders made, JSON, a final newline.

Standard library only at import time: ``bench_kvcache.py`` and ``compare_kv_events.py`` import
this from the peer venv, and ``clock_vs_measured.py`` from a test.

    meta = machine_meta()
    runs = alternate({"pagedkv": ours, "peer": theirs}, repeats=5)   # every result, by name
    med = medians(runs)                                              # {"pagedkv": ..., "peer": ...}
    write_json("results/x.json", {"meta": finish_meta(meta), "median_s": med})
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")
REPO = Path(__file__).resolve().parents[1]

# -- timing ------------------------------------------------------------------------------------


def seconds(fn: Callable[..., object], *args: object, clock=time.perf_counter) -> float:
    """Seconds ``fn(*args)`` takes on ``clock`` (``time.process_time``: this process's CPU
    time, which other jobs on a shared machine do not inflate)."""
    t0 = clock()
    fn(*args)
    return clock() - t0


@contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector paused (after one collection) inside the block, so that a side
    does not pay for a collection the other side's garbage triggered."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def cpu_burner(on: bool = True) -> Iterator[None]:
    """One process spinning on a CPU inside the block (``on``), killed by its PID after: the
    "another busy process" condition, started the same way by every benchmark that measures
    it. The 5 s after the kill let the load average fall before the next condition runs."""
    if not on:
        yield
        return
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()
        time.sleep(5)


def samples_s(
    fn: Callable[[], object], repeats: int, *, warmup: bool = True, clock=time.perf_counter
) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one untimed call unless
    ``warmup`` is false (a first call pays for allocations, caches, lazily built kernels)."""
    if warmup:
        fn()
    return [seconds(fn, clock=clock) for _ in range(repeats)]


def median_s(
    fn: Callable[[], object], repeats: int, *, warmup: bool = True, clock=time.perf_counter
) -> float:
    """The median of ``samples_s(fn, repeats, ...)``."""
    return statistics.median(samples_s(fn, repeats, warmup=warmup, clock=clock))


def round_order(names: Sequence[K], round_index: int) -> list[K]:
    """``names`` in order for an even round, reversed for an odd one (the module's rule)."""
    return list(names)[:: -1 if round_index % 2 else 1]


def alternate(
    calls: Mapping[K, Callable[[], V]],
    repeats: int,
    *,
    warmup: bool = False,
    after_round: Callable[[], None] | None = None,
) -> dict[K, list[V]]:
    """Every call once per round for ``repeats`` rounds in ``round_order``; what each returned,
    by name, in round order. ``warmup`` calls each once first (results dropped);
    ``after_round`` runs after each round (e.g. to sample the machine beside the runs)."""
    if warmup:
        for call in calls.values():
            call()
    out: dict[K, list[V]] = {name: [] for name in calls}
    for r in range(repeats):
        for name in round_order(list(calls), r):
            out[name].append(calls[name]())
        if after_round is not None:
            after_round()
    return out


def alternate_s(
    fns: Mapping[K, Callable[[], object]],
    repeats: int,
    *,
    warmup: bool = True,
    clock=time.perf_counter,
) -> dict[K, list[float]]:
    """``alternate`` timing each call: seconds per round, by name (one warm-up call each)."""
    timed = {name: (lambda fn=fn: seconds(fn, clock=clock)) for name, fn in fns.items()}
    return alternate(timed, repeats, warmup=warmup)


def medians(samples: Mapping[K, Sequence[float]]) -> dict[K, float]:
    """The median of each non-empty list of samples."""
    return {name: statistics.median(v) for name, v in samples.items() if v}


def ratios(values: Mapping[K, float], base: K) -> dict[K, float]:
    """``values[base] / values[name]`` for every name: for rates, > 1 means ``base`` is faster;
    for times, > 1 means ``name`` is faster."""
    return {name: values[base] / v for name, v in values.items()}


# -- the machine ---------------------------------------------------------------------------------


def read_bandwidth_gb_s() -> float:
    """Bytes per second of one pass over a 512 MiB tensor (a sum: reads only, all threads), the
    best rate a decode step at batch 1 can read its weights at. Best of 5."""
    import torch

    data = torch.ones(128 << 20, dtype=torch.float32)
    return data.numel() * 4 / min(samples_s(data.sum, 5, warmup=False)) / 1e9


def decode_weight_bytes(model) -> int:
    """Bytes a decode step reads: every parameter and buffer but the embedding table (only a
    row of it is read; a tied lm_head counts once, as a projection)."""
    skip = {id(model.embed_tokens.weight)} if model.embed_tokens is not None else set()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in skip}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on this platform
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                             timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_meta(**extra: Any) -> dict[str, Any]:
    """What measured this run, taken at its start: CPU model, cores (all, and those this
    process may use), 1/5/15-minute load averages, Python and torch versions (and torch's CPU
    capability when torch is loaded), the git commit and whether tracked files differ from it.
    ``extra`` (a script's own settings) is added last."""
    torch = sys.modules.get("torch")
    status = _git("status", "--porcelain", "--untracked-files=no")
    meta: dict[str, Any] = {
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_avg_before": _load_avg(),
        "torch": _version("torch"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability() if torch else None,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
    }
    return {**meta, **extra}


def finish_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with the load averages at the end of the run and the end time (in place)."""
    meta["load_avg_after"] = _load_avg()
    meta["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return meta


def machine_line(meta: Mapping[str, Any]) -> str:
    """``"<CPU model>, <n> CPUs, load average <1-minute>"`` for a printed report."""
    load = meta.get("load_avg_before") or [float("nan")]
    return f"{meta['cpu_model']}, {meta['cpu_count']} CPUs, load average {load[0]:.2f}"


# -- results -------------------------------------------------------------------------------------


def write_json(path: str | os.PathLike[str], data: Any, indent: int = 2) -> Path:
    """Write ``data`` as JSON (and a final newline) to ``path``, making its folders; the path."""
    return write_text(path, json.dumps(data, indent=indent) + "\n")


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it: a
    process killed mid-write leaves the previous version), making its folders; the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, out)
    return out
