"""The clock of pagedkv's own engine on one GPU (``pagedkv calibrate --from-gpu-check``): the
numbers ``sim/pagedkv_triton/cost.py`` prices a step with, and their JSON file.

Unlike ``GPUClock`` (``sim/vllm_class/clock.py``, fitted to Vidur's profiles: a vLLM-class engine,
cuBLAS GEMMs and FlashAttention over a block table), this clock describes the engine pagedkv
ships: its Triton paged decode (a law in the block size chosen by the ledger's rows,
``sim/pagedkv_triton/decode_law.py``), its Triton prefill kernel (which also runs a mixed step's decode rows),
its per-step host cost eager and with CUDA graphs, fitted to the device check's timed steps.
``sources`` says, part by part, what each number was fitted on or borrowed from.

Fields (seconds; ``*_eff`` are fractions of the datasheet):

- ``decode_law`` and ``decode``: the paged decode kernel, per layer call.
- ``prefill_launch_s``, ``prefill_decode_token_s``, ``prefill_pair_s``: the prefill kernel per
  layer: launch + (query heads x decode-row KV tokens x ``prefill_decode_token_s`` + query heads
  x chunk query-key pairs / 16 x ``prefill_pair_s``) / SM count, at the block size measured
  (``ref_block_size``), scaled to others by the decode law's per-token ratio.
- ``gemm_*``: the projections, ``vllm_class/clock.gemm_s``'s law; ``gpu_per_token_s``: every other
  kernel of a layer (norms, RoPE, activation, residual adds, KV write) per new token.
- ``host_base_s`` + ``host_per_seq_s`` x sequences + ``host_per_table_entry_s`` x sequences x
  the block table's width (the longest sequence's blocks: every row is padded to it) +
  ``host_per_token_s`` x new tokens: the step's host work (schedule, inputs, sampling,
  outputs: the table is built on the host a row per sequence, and every output snapshot copies
  its sequence's ids); the last two are 0 in a clock fitted without host-only steps (they are
  measured by a device check's ``clock`` section); ``launch_per_layer_s``: the eager forward's kernel launches per layer,
  overlapped with the GPU's work as ``(launch^p + gpu^p)^(1/p)``, ``p = overlap_p`` (1: in
  series, large: fully hidden); ``graph_replay_s``: what a decode step replayed from a CUDA
  graph pays instead of the launches.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError, read_json
from pagedkv.sim.pagedkv_triton.decode_law import check_params

ENGINE_CLOCK_FORMAT = "pagedkv-engine-clock"
ENGINE_CLOCK_VERSION = 1
ENGINE = "pagedkv-triton"
DESCRIBES = (
    "pagedkv's own engine: Triton paged decode and prefill, torch/cuBLAS projections, its "
    "host loop eager and with CUDA graphs"
)
# The clock's parts, each fitted or borrowed as a whole (``sources`` keys)
PARTS = (
    "decode_attention",
    "prefill_attention",
    "gemm",
    "elementwise",
    "host",
    "host_eager",
    "host_graphs",
)


@dataclass(frozen=True)
class EngineClock:
    """See the module docstring. Validated on construction (ValueError)."""

    gpu: str
    decode_law: str
    decode: dict[str, float]
    ref_block_size: int
    prefill_launch_s: float
    prefill_decode_token_s: float
    prefill_pair_s: float
    gemm_launch_s: float
    gemm_bw_eff: float
    gemm_flops_eff: float
    gemm_knee: float
    gpu_per_token_s: float
    host_base_s: float
    host_per_seq_s: float
    launch_per_layer_s: float
    overlap_p: float
    graph_replay_s: float
    host_per_table_entry_s: float = 0.0
    host_per_token_s: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_params(self.decode_law, self.decode)
        if isinstance(self.ref_block_size, bool) or not isinstance(self.ref_block_size, int):
            raise ValueError(f"ref_block_size must be a whole number, got {self.ref_block_size!r}")
        if self.ref_block_size < 1:
            raise ValueError(f"ref_block_size must be >= 1, got {self.ref_block_size}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type != "float":
                continue
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
                raise ValueError(f"engine clock: {f.name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"engine clock: {f.name} must be finite and >= 0, got {value!r}")
        for name in ("gemm_bw_eff", "gemm_flops_eff", "gemm_knee"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine clock: {name} must be > 0")
        if self.overlap_p < 1:
            raise ValueError(f"engine clock: overlap_p must be >= 1, got {self.overlap_p}")
        unknown = set(self.sources) - set(PARTS)
        if unknown:
            raise ValueError(f"engine clock: unknown parts in sources {sorted(unknown)}")


def clock_to_dict(clock: EngineClock, meta: dict[str, Any]) -> dict[str, Any]:
    """The file's record: format, version, what it describes, ``meta`` (fit reports), the
    parameters."""
    params = asdict(clock)
    gpu, sources = params.pop("gpu"), params.pop("sources")
    return {
        "format": ENGINE_CLOCK_FORMAT,
        "version": ENGINE_CLOCK_VERSION,
        "engine": ENGINE,
        "describes": DESCRIBES,
        "gpu": gpu,
        "sources": sources,
        **meta,
        "params": params,
    }


def write_engine_clock(path: str | Path, clock: EngineClock, meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(clock_to_dict(clock, meta), indent=1) + "\n")


def is_engine_clock(data: Any) -> bool:
    """Whether parsed JSON claims to be an engine clock (then ``parse_engine_clock`` it)."""
    return isinstance(data, dict) and data.get("format") == ENGINE_CLOCK_FORMAT


def parse_engine_clock(data: Any, source: str) -> tuple[EngineClock, dict[str, Any]]:
    """The clock and the rest of the record; UsageError starting with ``source`` for anything
    that is not a version-1 engine clock with valid parameters."""
    if not is_engine_clock(data):
        raise UsageError(
            f'{source}: not a pagedkv engine clock (no "format": "{ENGINE_CLOCK_FORMAT}")'
        )
    if data.get("version") != ENGINE_CLOCK_VERSION:
        raise UsageError(
            f"{source}: engine clock version {data.get('version')!r} is not "
            f"supported (this pagedkv reads {ENGINE_CLOCK_VERSION})"
        )
    params, gpu, sources = data.get("params"), data.get("gpu"), data.get("sources", {})
    if not isinstance(params, dict) or not isinstance(gpu, str) or not isinstance(sources, dict):
        raise UsageError(
            f"{source}: an engine clock needs 'gpu' (a name), 'params' and 'sources' (objects)"
        )
    if not isinstance(params.get("decode"), dict):
        raise UsageError(f"{source}: params.decode must be an object of the law's parameters")
    try:
        clock = EngineClock(gpu=gpu, sources=dict(sources), **params)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{source}: bad engine clock parameters ({exc})") from None
    meta = {k: v for k, v in data.items() if k not in ("params", "gpu", "sources")}
    return clock, meta


def read_engine_clock(path: str | Path) -> tuple[EngineClock, dict[str, Any]]:
    """The engine clock in ``path``; UsageError naming the file when it cannot be read, is not
    JSON or not a valid engine clock."""
    return parse_engine_clock(read_json(path, "engine clock"), str(path))
