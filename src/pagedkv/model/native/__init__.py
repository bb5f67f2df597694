"""pagedkv's compiled CPU kernels (``native_chain.c`` and ``native_gemm.c``, the projections on
fp32 rows or GGUF's Q4_1/Q8_0 blocks; ``native_kernels.c``, norms, activations and the
one-call decode layer; ``native_attention.c``, paged attention): built
once with the system C compiler into one library, cached, loaded with ctypes, called on torch
tensors' memory. The projections' microkernel has an AVX-512 form beside the AVX2 one, chosen
once per process by rule (``isa()``).

``kernels()`` returns the loaded library, or None with ``unavailable_reason()`` saying why
(not x86-64, no AVX2/FMA, no compiler, a second OpenMP runtime, ``PAGEDKV_NATIVE=0``, a
``PAGEDKV_NATIVE_ISA`` this CPU cannot run). Every caller keeps a torch path for None. The C
code trusts its arguments: the callers (``native/projection``, ``native/quant``,
``layers.RMSNorm``/``SwiGLU``, ``decoder_layer``, ``attention``) pass contiguous memory (fp32,
or uint8 blocks) of the shapes the kernel comments state, and check it before each call. F16C
(the blocks' fp16 scales) comes with every AVX2 CPU.

The build: ``cc -O3 -mavx2 -mfma -mf16c -fopenmp`` into ``$XDG_CACHE_HOME/pagedkv/native/``
under a name keyed by the sources, the compiler and the flags (~0.7 s, once); written to a
temporary file and renamed, so concurrent processes never load half a library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_kernels.c")
# Built into the same library: the quantized projections, paged attention, the headers.
QUANT_SOURCE = Path(__file__).with_name("native_quant_kernels.c")
ATTENTION_SOURCE = Path(__file__).with_name("native_attention.c")  # paged attention
GEMM_SOURCE = Path(__file__).with_name("native_gemm.c")  # the projections of 9 rows and more
CHAIN_SOURCE = Path(__file__).with_name("native_chain.c")  # ... and of fewer
HEADERS = tuple(
    Path(__file__).with_name(h)
    for h in (
        "native_linear.h",
        "native_simd.h",
        "native_dequant.h",
        "native_gemm_tiles.h",
        "native_attention512.h",
    )
)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# Up to this many rows a projection calls pk_linear (pk_decode_layer's entry points too: up to
# 8 rows native_chain.c, from 9 the GEMM), above pk_gemm, or MKL where the GEMM is switched
# off (native.set_gemm). Both sides compute the same bits (latency.md, tenth round).
MAX_ROWS = 64
# Paged attention keeps a work item's queries and outputs on the stack, sized for heads of up to
# this many dims (native_attention.c's MAX_D): MLA's latent record, 512 + 64, is one head.
MAX_HEAD_DIM = 576

_state: dict[str, object] = {}
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "pk_linear": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT],  # returns 0, -1: no memory
    "pk_gemm": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT],  # returns 0, -1: no memory
    "pk_gemm_blocks": [_INT, _P, _P, _P, _P, _P, _I64, _I64, _I64, _INT],  # -2: bad format
    "pk_linear_q4_1": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT],  # returns 0, -1: no memory
    "pk_linear_q8_0": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT],
    "pk_dequantize": [_INT, _P, _P, _I64, _I64, _INT],
    "pk_rms_norm": [_P, _P, _P, _I64, _I64, _F, _INT],
    "pk_silu_mul": [_P, _I64, _P, _I64, _P, _I64, _I64, _INT],
    "pk_paged_attention": [_P, _I64, _P, _P, _P, _I64, *[_P] * 4, *[_I64] * 5, _F, _INT],
    "pk_paged_attention_bf16": [_P, _I64, _P, _P, _P, _I64, *[_P] * 4, *[_I64] * 5, _F, _INT],
    "pk_set_isa": [_INT],
    "pk_rope_store": [_P, _I64, _P, _P, _P, _P, _P, *[_I64] * 4, _INT],
    "pk_decode_layer": [
        _P,
        _I64,
        _I64,
        _P,
        _P,
        _F,
        _P,  # the four projections' formats (int32 [4])
        *[_P] * 5,
        *[_I64] * 4,
        *[_P] * 6,
        _I64,
        _P,
        _I64,
        _F,
        _P,
        _INT,
    ],
}


_RETURN_STATUS = {
    "pk_linear",
    "pk_gemm",
    "pk_gemm_blocks",
    "pk_linear_q4_1",
    "pk_linear_q8_0",
    "pk_decode_layer",
}


def kernels() -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None; the answer is kept per process."""
    if _state.get("off"):
        return None
    if "lib" not in _state:
        try:
            _state["lib"], _state["reason"] = _load(), ""
        except _Unavailable as exc:
            _state["lib"], _state["reason"] = None, str(exc)
    return _state["lib"]  # type: ignore[return-value]


ISAS = ("avx2", "avx512")


def isa() -> str:
    """The form the projections' microkernel takes in this process ("avx2" or "avx512"; ""
    when the kernels are unavailable): chosen at load by rule, ``PAGEDKV_NATIVE_ISA`` if set,
    else "avx512" where torch reports the CPU capable of it (AVX512F/BW/VL/DQ), else "avx2".
    Both compute every product element as one FMA chain in k order (``native_chain.c``,
    ``native_gemm.c``), so they give the same bits: the ISA changes the speed, not the tokens."""
    return str(_state.get("isa", "")) if kernels() is not None else ""


def set_isa(name: str) -> None:
    """Switch the microkernel's form for every model of this process (tests, A/B benchmarks);
    ``ValueError`` for a name not in ``ISAS`` or "avx512" on a CPU without it."""
    lib = kernels()
    if lib is None:
        raise ValueError(f"the native kernels are unavailable: {unavailable_reason()}")
    _apply_isa(lib, name)


def _apply_isa(lib: ctypes.CDLL, name: str) -> None:
    """The one place the form is checked against the CPU and handed to the library."""
    if name not in ISAS:
        raise ValueError(f"ISA {name!r}: choose from {', '.join(ISAS)}")
    if name == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        raise ValueError("ISA avx512: this CPU (or torch's view of it) has no AVX-512")
    lib.pk_set_isa(int(name == "avx512"))
    _state["isa"] = name


def gemm_kernels() -> ctypes.CDLL | None:
    """The library when ``pk_gemm`` multiplies the rows above ``MAX_ROWS`` (the default
    wherever the kernels load), else None: MKL's GEMM does."""
    return None if _state.get("gemm_off") else kernels()


def set_gemm(enabled: bool) -> None:
    """Multiply more than ``MAX_ROWS`` rows on ``pk_gemm`` (True) or MKL (False) from now on,
    in this process: A/B benchmarks and tests. The choice changes the products' bits."""
    _state["gemm_off"] = not enabled


def unavailable_reason() -> str:
    """Why ``kernels()`` is None ("" when it is not)."""
    if _state.get("off"):
        return "switched off (native.set_enabled(False))"
    kernels()
    return str(_state["reason"])


def set_enabled(enabled: bool) -> None:
    """Switch the kernels off (or back on) for models loaded from now on, in this process:
    the torch paths, for A/B benchmarks and tests. Models already loaded keep their choice."""
    _state["off"] = not enabled


class _Unavailable(Exception):
    pass


def _load() -> ctypes.CDLL:
    if os.environ.get("PAGEDKV_NATIVE", "1") == "0":
        raise _Unavailable("PAGEDKV_NATIVE=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise _Unavailable(f"the kernels are x86-64 AVX2, this is {platform.machine()}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise _Unavailable(f"the CPU lacks AVX2/FMA (torch reports {capability})")
    if "OpenMP" not in torch.__config__.parallel_info().split("parallel backend:")[-1]:
        raise _Unavailable("torch's parallel backend is not OpenMP")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise _Unavailable("no C compiler (cc/gcc) on PATH")
    path = _build(compiler)
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = _INT if name in _RETURN_STATUS else None
    chosen = os.environ.get("PAGEDKV_NATIVE_ISA") or (
        "avx512" if capability == "AVX512" else "avx2"
    )
    try:
        _apply_isa(lib, chosen)
    except ValueError:
        raise _Unavailable(
            f"PAGEDKV_NATIVE_ISA={chosen}: choose avx2, or avx512 on a CPU with it"
        ) from None
    runtimes = _openmp_runtimes()
    if len(runtimes) != 1:  # two thread pools spinning on the same cores: many times slower
        raise _Unavailable(f"a second OpenMP runtime was loaded: {sorted(runtimes)}")
    return lib


def _build(compiler: str) -> Path:
    sources = (SOURCE, QUANT_SOURCE, ATTENTION_SOURCE, GEMM_SOURCE, CHAIN_SOURCE)
    source = b"".join(p.read_bytes() for p in (*sources, *HEADERS))
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedkv" / "native"
    path = cache / f"native_kernels-{key}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    print(f"pagedkv: building the native kernels into {path} (once, ~1 s)", file=sys.stderr)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [
                compiler,
                *FLAGS,
                f"-I{HEADERS[0].parent}",
                *map(str, sources),
                "-o",
                tmp,
                "-lm",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise _Unavailable(f"{compiler} failed: {done.stderr.strip()[:300]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _openmp_runtimes() -> set[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: trust the soname rule
        return {"?"}
    names = {line.split()[-1] for line in maps.splitlines() if "gomp" in line or "libiomp" in line}
    return {n for n in names if n.endswith((".so", ".so.1")) or ".so." in n}
