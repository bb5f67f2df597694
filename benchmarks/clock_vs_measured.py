"""How far is the simulator's GPU clock from measured GPU time? Every measured op under --data
priced by the clock pagedkv ships for that GPU, error per op family, GPU and model.

    python benchmarks/clock_vs_measured.py --data ../shared/data/gpu_profiles \\
        --data data/gpu_profiles [--json results/clock_vs_measured.json] [--baseline] \\
        [--sensitivity] [--clock FILE]

--data folders are laid out as Vidur's published profiles (``pagedkv calibrate --help``); the
model's shape comes from the rows themselves, and a GPU folder (``a100``, ``h100``, ...) is
priced with the preset of that name (``sim/gpus.py`` aliases) and its shipped clock
(``sim/clock_presets.py``: its own fit, else its architecture's), or every folder with
--clock FILE. The relative error of a row is ``predicted / measured - 1``.

Beside each group's errors: ``floor``, the smallest maximum error that *any* clock which never
predicts less time for more work (more tokens, a longer context, more sequences) could reach on
those rows: ``max (y_i - y_j) / (y_i + y_j)`` over pairs where row ``j`` does at least row
``i``'s work but was measured faster. It says how much of a max error is the measurement's own
non-monotonicity (kernel heuristics switching tiles, 1 us timer steps, caches) rather than the
model's. --baseline adds the errors of the datasheet roofline the simulator used before
(``max(bytes / peak BW, FLOPs / peak)`` per op, the old flash-attn block walk, elementwise ops
unpriced, 2 ms a step). --sensitivity prints how a Llama-3-8B step's time moves when each
fitted parameter moves by one sigma of its fit. --cross-validate fits again without part of
the rows and prices that part (needs scipy): each model left out in turn (GEMMs, elementwise),
and the longer half of the attention rows (contexts, chunks > 1,024 tokens) predicted from the
shorter half: the clock on work it was not fitted to.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, when a test loads this file
from common import finish_meta, machine_meta, write_json  # noqa: E402
from pagedkv.sim.clock_presets import clock_for
from pagedkv.sim.costs.kernel import KERNELS
from pagedkv.sim.gpus import GPUSpec, get_gpu
from pagedkv.sim.vllm_class.data import FAMILIES, OpRow, price, read_rows
from pagedkv.sim.vllm_class.fit import read_clock, summarize_errors, with_params


def roofline_price(row: OpRow, gpu: GPUSpec) -> float:
    """The pre-fit simulator's price of one op: datasheet peaks, nothing else."""
    bw, peak, d = gpu.mem_bandwidth_bytes_per_s, gpu.peak_flops_per_s, row.dims
    if row.family == "gemm":
        m, k, n = d
        return max(2 * (k * n + m * k + m * n) / bw, 2 * m * k * n / peak)
    if row.family == "elementwise":
        return 1e-12  # not priced
    if row.family == "decode_attention":
        seqs, ctx, kv, hd = d
        blocks = seqs * math.ceil(ctx / 16)
        fa = KERNELS["flash-attn"]
        walk = blocks * kv * fa.iteration_latency_s / (fa.warps_per_sm * gpu.num_sms)
        return max(blocks * 16 * kv * 4 * hd / bw, walk)
    if row.family == "prefill_attention":
        chunk, cached, q, hd = d
        pairs = chunk * cached + chunk * (chunk + 1) / 2
        return 4 * q * hd * pairs / peak
    return 0.002


def _curve_key(row: OpRow) -> tuple[tuple, float]:
    """(the curve a row lies on, its amount of work along that curve)."""
    d = row.dims
    if row.family in ("gemm", "elementwise"):
        return (row.file, row.op, row.model, row.tp), float(d[0])
    if row.family == "decode_attention":
        return (row.file, d[0]), float(d[1])
    if row.family == "prefill_attention":
        return (row.file, d[0]), float(d[1])
    return (row.file, row.model, row.tp), float(d[0])


def monotone_floor(rows: Sequence[OpRow]) -> float:
    """The least max relative error of any non-decreasing clock (module docstring)."""
    curves: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        key, x = _curve_key(r)
        curves[key][x].append(r.measured_s)
    floor = 0.0
    for points in curves.values():
        prev_max = 0.0
        for x in sorted(points):
            ys = points[x]
            lo, hi = min(ys), max(ys)
            top = max(prev_max, hi)
            floor = max(floor, (top - lo) / (top + lo))
            prev_max = top
    return floor


def report(rows: list[OpRow], clock_file: str | None, baseline: bool) -> list[dict]:
    records = []
    groups: dict[tuple[str, str, str], list[OpRow]] = defaultdict(list)
    for r in rows:
        groups[(r.family, r.gpu, r.model)].append(r)
        groups[(r.family, r.gpu, "all")].append(r)
    clocks = {}
    for (family, gpu_name, model), mine in sorted(groups.items()):
        if gpu_name not in clocks:
            gpu = get_gpu(gpu_name)
            clocks[gpu_name] = (gpu, *clock_for(gpu, clock_file))
        gpu, clock, source = clocks[gpu_name]
        rec = {"family": family, "gpu": gpu_name, "model": model, "clock": source,
               **summarize_errors([price(r, clock, gpu) / r.measured_s - 1 for r in mine]),
               "floor": monotone_floor(mine)}  # fmt: skip
        if baseline:
            old = summarize_errors([roofline_price(r, gpu) / r.measured_s - 1 for r in mine])
            rec["baseline"] = {k: v for k, v in old.items() if k != "rows"}
        records.append(rec)
    return records


def print_markdown(records: list[dict], baseline: bool) -> None:
    head = "| family | GPU | model | rows | median | p95 | max | floor |"
    sep = "|---|---|---|---:|---:|---:|---:|---:|"
    if baseline:
        head += " before: median | before: max |"
        sep += "---:|---:|"
    print(head)
    print(sep)
    order = {f: i for i, f in enumerate(FAMILIES)}
    for r in sorted(
        records, key=lambda r: (r["model"] != "all", order[r["family"]], r["gpu"], r["model"])
    ):
        line = (f"| {r['family']} | {r['gpu']} | {r['model']} | {r['rows']:,} | "
                f"{r['median_rel_err']:.1%} | {r['p95_rel_err']:.1%} | {r['max_rel_err']:.1%} | "
                f"{r['floor']:.1%} |")  # fmt: skip
        if baseline:
            b = r["baseline"]
            line += f" {b['median_rel_err']:.1%} | {b['max_rel_err']:.1%} |"
        print(line)


def sensitivity(clock_file: str | None) -> list[dict]:
    """Step time of Llama-3-8B on A100-80GB at three step shapes, each fitted parameter moved
    by +1 sigma (its log by sigma): the relative change of each step."""
    from pagedkv.pages.sources import load_shape
    from pagedkv.sched.step_shape import StepShape
    from pagedkv.sim.cost_model import ModelCost
    from pagedkv.sim.vllm_class.cost import FittedCostModel

    gpu = get_gpu("A100-80GB")
    clock, _ = clock_for(gpu, clock_file)
    path = clock_file or str(
        Path(__file__).parents[1] / "src/pagedkv/presets/clocks/A100-80GB.json"
    )
    sigmas = read_clock(path)[1].get("rel_sigma", {})
    model = ModelCost.from_shape(load_shape("llama-3-8b"))
    shapes = {
        "decode 64 x 1k": StepShape.of([(1024, 1)] * 64, 16),
        "prefill 2k": StepShape.of([(0, 2048)], 16),
        "mixed 32 x 1k + 512": StepShape.of([(1024, 1)] * 32 + [(0, 512)], 16),
    }
    base = {k: FittedCostModel(model, gpu, clock).step_time_s(s) for k, s in shapes.items()}
    out = []
    from pagedkv.sim.vllm_class.fit import get_param

    for name, sigma in sorted(sigmas.items()):
        rec: dict = {"param": name, "rel_sigma": sigma}
        for tag, factor in (("sigma", math.exp(sigma)), ("10%", 1.1)):
            cost = FittedCostModel(
                model, gpu, with_params(clock, {name: get_param(clock, name) * factor})
            )
            rec[tag] = {k: cost.step_time_s(s) / base[k] - 1 for k, s in shapes.items()}
        out.append(rec)
    cols = [(tag, k) for tag in ("sigma", "10%") for k in shapes]
    print(f"\n| parameter | sigma | {' | '.join(f'{k} (+{tag})' for tag, k in cols)} |")
    print("|---|---:|" + "---:|" * len(cols))
    for r in out:
        cells = " | ".join(f"{r[tag][k]:+.2%}" for tag, k in cols)
        print(f"| {r['param']} | {r['rel_sigma']:.1%} | {cells} |")
    total = " | ".join(f"{math.sqrt(sum(r[t][k] ** 2 for r in out)):.2%}" for t, k in cols)
    print(f"| all (root sum of squares) | | {total} |")
    print("base step times: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in base.items()))
    return out


def _held_out(rows: list[OpRow], test, gpu_name: str, label: str) -> dict:
    from pagedkv.sim.vllm_class.fit import fit_clock

    gpu = get_gpu(gpu_name)
    base, _ = clock_for(gpu)
    train = [r for r in rows if not test(r)]
    held = [r for r in rows if test(r)]
    clock, _ = fit_clock(train, gpu, base)
    out = summarize_errors([price(r, clock, gpu) / r.measured_s - 1 for r in held])
    return {"gpu": gpu_name, "held_out": label, "trained_rows": len(train), **out}


def cross_validate(rows: list[OpRow]) -> list[dict]:
    """Leave-one-model-out (GEMMs and elementwise ops) and short-to-long (attention)."""
    out = []
    for gpu_name in sorted({r.gpu for r in rows}):
        mine = [r for r in rows if r.gpu == gpu_name]
        for family in ("gemm", "elementwise"):
            fam = [r for r in mine if r.family == family]
            models = sorted({r.model for r in fam if "/" in r.model})
            for model in models:
                others = [r for r in fam if r.model != model and "/" in r.model]
                if others:
                    subset = [r for r in fam if "/" in r.model]
                    rec = _held_out(subset, lambda r, m=model: r.model == m, gpu_name, model)
                    out.append({"family": family, **rec})
        for family, dim in (("decode_attention", 1), ("prefill_attention", 0)):
            fam = [r for r in mine if r.family == family]
            if fam:
                rec = _held_out(fam, lambda r, d=dim: r.dims[d] > 1024, gpu_name, "> 1,024 tokens")
                out.append({"family": family, **rec})
    print("\n| family | GPU | held out | fitted on | rows | median | p95 | max |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in out:
        print(f"| {r['family']} | {r['gpu']} | {r['held_out']} | {r['trained_rows']:,} | "
              f"{r['rows']:,} | {r['median_rel_err']:.1%} | {r['p95_rel_err']:.1%} | "
              f"{r['max_rel_err']:.1%} |")  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", action="append", required=True, metavar="DIR")
    ap.add_argument("--json", metavar="OUT", help="write one record per family x GPU x model")
    ap.add_argument("--clock", metavar="FILE", help="price every GPU folder with this clock")
    ap.add_argument("--baseline", action="store_true", help="also the pre-fit roofline's errors")
    ap.add_argument("--sensitivity", action="store_true", help="step time vs each parameter")
    ap.add_argument("--cross-validate", action="store_true", help="fit without a part, price it")
    args = ap.parse_args(argv)
    meta = machine_meta()
    rows = [r for d in args.data for r in read_rows(d)]
    records = report(rows, args.clock, args.baseline)
    print_markdown(records, args.baseline)
    result: dict = {"records": records, "data": args.data}
    if args.sensitivity:
        result["sensitivity"] = sensitivity(args.clock)
    if args.cross_validate:
        result["cross_validation"] = cross_validate(rows)
    if args.json:
        write_json(args.json, {**result, "meta": finish_meta(meta)}, indent=1)
    summary = [r for r in records if r["model"] == "all"]
    print(f"\n{len(rows):,} rows; median of the group medians "
          f"{statistics.median(r['median_rel_err'] for r in summary):.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    from pagedkv.errors import UsageError

    try:
        raise SystemExit(main())
    except UsageError as exc:  # a folder that is not a profile, a GPU without a preset
        print(f"clock_vs_measured: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
