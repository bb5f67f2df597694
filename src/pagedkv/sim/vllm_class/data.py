"""Measured GPU op times, read from files laid out as Vidur's published profiles, and priced.

A data folder holds any of (``<gpu>`` is a folder name such as ``a100``, ``h100``)::

    compute/<gpu>/<org>/<model>/mlp.csv   one layer's non-attention ops per token count and TP
    compute/<gpu>/<org>/<model>/attention.csv   that model's attention kernel
    <gpu>/mlp*.csv                        the same columns
    <gpu>/attention*.csv                  the attention kernel: decode and prefill rows
    <gpu>/cpu_overheads.csv               a step's CPU work per batch size

Times are in milliseconds (``time_stats.<op>.median``); the model's shape comes from each row's
own columns (``n_head``, ``n_kv_head``, ``n_embd``, ``n_expanded_embd``, TP degree, ...), so a
row is priced without knowing the model's name. ``OpRow.measured_s`` is seconds.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import UsageError
from pagedkv.sim.gpus import GPUSpec
from pagedkv.sim.vllm_class import clock as gc

FAMILIES = ("gemm", "elementwise", "decode_attention", "prefill_attention", "step_overhead")
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# The CPU parts of one step in cpu_overheads.csv (the model's own execution is the GPU's).
CPU_PARTS = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")


@dataclass(frozen=True)
class OpRow:
    """One measured op. ``dims``: GEMM ``(m, k, n)``; elementwise ``(bytes,)``; decode
    ``(num_seqs, context, kv_heads, head_dim)``; prefill ``(chunk, cached, query_heads,
    head_dim)``; step overhead ``(num_seqs, tp)`` — all per GPU (TP already applied)."""

    family: str
    op: str
    gpu: str  # the folder name
    model: str  # "<org>/<model>" or a shape label
    tp: int
    dims: tuple[int, ...]
    measured_s: float
    file: str  # <data folder name>/<path inside it>


def price(row: OpRow, clock: gc.GPUClock, gpu: GPUSpec) -> float:
    """What ``clock`` says ``row``'s op takes on ``gpu`` (seconds)."""
    d = row.dims
    if row.family == "gemm":
        return gc.gemm_s(clock, gpu, *d)
    if row.family == "elementwise":
        return gc.elementwise_s(clock, gpu, row.op, d[0])
    if row.family == "decode_attention":
        return gc.decode_attention_s(clock, gpu, d[0], d[1], d[2], d[3])
    if row.family == "prefill_attention":
        return gc.prefill_attention_s(clock, gpu, 1, d[0], d[1], d[2], d[3])
    return gc.step_overhead_s(clock, d[0], d[1])


def _int(rec: dict[str, str], key: str, where: str) -> int:
    try:
        return int(float(rec[key]))
    except (KeyError, ValueError):
        raise UsageError(f"{where}: column {key!r} missing or not a number") from None


def _ms(rec: dict[str, str], key: str) -> float | None:
    text = rec.get(key, "")
    try:
        value = float(text) / 1000.0
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _mlp_rows(path: Path, gpu: str, model: str, name: str) -> Iterator[OpRow]:
    for i, rec in enumerate(csv.DictReader(path.open(newline="")), start=2):
        where = f"{path}:{i}"
        h, heads = _int(rec, "n_embd", where), _int(rec, "n_head", where)
        kv, inter = _int(rec, "n_kv_head", where), _int(rec, "n_expanded_embd", where)
        tp, m = _int(rec, "num_tensor_parallel_workers", where), _int(rec, "num_tokens", where)
        gated = rec.get("use_gated_mlp", "True").strip().lower() == "true"
        hd = h // heads
        label = model or f"h{h}-q{heads}-kv{kv}-i{inter}"
        shapes = {
            "attn_pre_proj": (h, (heads + 2 * kv) * hd // tp),
            "attn_post_proj": (heads * hd // tp, h),
            "mlp_up_proj": (h, (2 if gated else 1) * inter // tp),
            "mlp_down_proj": (inter // tp, h),
        }
        for op, (k, n) in shapes.items():
            t = _ms(rec, f"time_stats.{op}.median")
            if t is not None:
                yield OpRow("gemm", op, gpu, label, tp, (m, k, n), t, name)
        b = gc.ACT_BYTES
        moved = {  # bytes read + written by each elementwise kernel
            "emb": 2 * b * m * h,
            "input_layernorm": 2 * b * m * h,
            "post_attention_layernorm": 2 * b * m * h,
            "attn_rope": 2 * b * m * (heads + kv) * hd // tp,
            "mlp_act": (3 if gated else 2) * b * m * inter // tp,
            "add": 3 * b * m * h,
        }
        for op, num_bytes in moved.items():
            t = _ms(rec, f"time_stats.{op}.median")
            if t is not None:
                yield OpRow("elementwise", op, gpu, label, tp, (num_bytes,), t, name)


def _attention_rows(path: Path, gpu: str, name: str) -> Iterator[OpRow]:
    for i, rec in enumerate(csv.DictReader(path.open(newline="")), start=2):
        where = f"{path}:{i}"
        tp = _int(rec, "num_tensor_parallel_workers", where)
        q, kv, h = (
            _int(rec, "n_q_head", where),
            _int(rec, "n_kv_head", where),
            _int(rec, "n_embd", where),
        )
        hd, label = h // q, f"q{q}-kv{kv}-d{h // q}"
        q, kv = q // tp, max(1, kv // tp)
        context = _int(rec, "kv_cache_size", where)
        if rec.get("is_prefill", "").strip() == "True":
            t = _ms(rec, "time_stats.attn_prefill.median")
            dims = (_int(rec, "prefill_chunk_size", where), context, q, hd)
            family, op = "prefill_attention", "attn_prefill"
        else:
            t = _ms(rec, "time_stats.attn_decode.median")
            # the new token's own K/V is attended to as well
            dims = (_int(rec, "batch_size", where), context + 1, kv, hd)
            family, op = "decode_attention", "attn_decode"
        if t is not None:
            yield OpRow(family, op, gpu, label, tp, dims, t, name)


def _overhead_rows(path: Path, gpu: str, name: str) -> Iterator[OpRow]:
    for i, rec in enumerate(csv.DictReader(path.open(newline="")), start=2):
        where = f"{path}:{i}"
        parts = [_ms(rec, f"{p}_median") for p in CPU_PARTS]
        if any(p is None for p in parts):
            continue
        tp = _int(rec, "tensor_parallel_degree", where)
        total = sum(p for p in parts if p is not None)
        seqs = _int(rec, "batch_size", where)
        yield OpRow(
            "step_overhead", "cpu", gpu, rec.get("model_name", "?"), tp, (seqs, tp), total, name
        )


def read_rows(data_dir: str | Path) -> list[OpRow]:
    """Every measured op under ``data_dir`` (module docstring); UsageError when the folder is
    missing or holds none."""
    root = Path(data_dir)
    if not root.is_dir():
        raise UsageError(f"--data {str(root)!r}: not a folder")
    rows: list[OpRow] = []
    for path in sorted(root.rglob("*.csv")):
        parts = path.relative_to(root).parts
        name = "/".join((root.resolve().name, *parts))  # for reports: no machine's path
        if parts[0] == "compute" and len(parts) == 5 and path.name.startswith("mlp"):
            rows += _mlp_rows(path, parts[1], f"{parts[2]}/{parts[3]}", name)
        elif parts[0] == "compute" and len(parts) == 5 and path.name.startswith("attention"):
            rows += _attention_rows(path, parts[1], name)
        elif len(parts) == 2 and path.name.startswith("mlp"):
            rows += _mlp_rows(path, parts[0], "", name)
        elif len(parts) == 2 and path.name.startswith("attention"):
            rows += _attention_rows(path, parts[0], name)
        elif len(parts) == 2 and path.name == "cpu_overheads.csv":
            rows += _overhead_rows(path, parts[0], name)
    if not rows:
        raise UsageError(f"--data {str(root)!r}: no profile files laid out as Vidur's (see --help)")
    return rows
