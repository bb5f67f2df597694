"""pagedkv's Triton kernels compiled for a GPU on a machine without one: before device time.

A kernel that does not compile on the lent GPU's triton wastes the run (15 minutes a session,
starts included), and ``make test`` runs the kernels under the interpreter, which compiles
nothing. This runs the real compiler of a given triton release (default 3.6.0, the H200
image's) for a given architecture (default sm_90: H100/H200), front end to ``ptxas``, on every
kernel through the engine's own launch functions, so the constexprs, warps and argument
specialisations are the engine's: decode one pass and split-K (with and without rows), prefill,
K/V write, block copy, RoPE + K/V write, RMSNorm (+ residual), SiLU * up; bf16, fp32 (and fp16
for attention); head shapes of Llama-3-8B, SmolLM2 and a small GQA; block sizes from 1 to a
whole region. Nothing is launched; it reports each compile's shared memory, warps and stages.

    python benchmarks/triton_compile_check.py [--triton 3.6.0] [--arch 90] [--block-sizes 1,3,16,64,2048]

The release is fetched once from PyPI (``pip download``, this interpreter's wheel; its Python
sources and bundled ``ptxas`` are what the GPU image runs) into ~/.cache/pagedkv/, and the
check reruns itself with it first on the path. A stand-in for triton's GPU driver answers the
target (triton 3.6's ``runtime.driver.set_active``; another release may need another
stand-in) and ``JITFunction`` compiles with ``warmup=True``. Exit status 1 if any compile
fails. About 1-3 minutes on a laptop-class CPU.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = "PAGEDKV_COMPILE_CHECK_CHILD"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--triton", default="3.6.0", help="triton release (%(default)s)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability (%(default)s)")
    p.add_argument("--block-sizes", default="1,3,16,64,2048", help="tokens (%(default)s)")
    return p.parse_args(argv)


def triton_site(version: str) -> Path:
    """A folder holding triton ``version``'s package, fetched once from PyPI."""
    site = Path.home() / ".cache" / "pagedkv" / f"triton-{version}-py{sys.version_info[0]}" \
        f"{sys.version_info[1]}"  # fmt: skip
    if (site / "triton" / "__init__.py").exists():
        return site
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetching triton {version} from PyPI ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        f"triton=={version}", "-d", tmp], check=True)  # fmt: skip
        (wheel,) = Path(tmp).glob("triton-*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
            for info in z.infolist():  # extractall drops the modes: ptxas must stay executable
                if mode := info.external_attr >> 16:
                    os.chmod(site / info.filename, mode)
    return site


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get(CHILD) != args.triton:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with tempfile.TemporaryDirectory() as cache:
            env.update({CHILD: args.triton, "TRITON_CACHE_DIR": cache,
                        "PYTHONPATH": f"{triton_site(args.triton)}{os.pathsep}{REPO / 'src'}"})  # fmt: skip
            return subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:])],
                                  env=env).returncode  # fmt: skip
    return check(args)


def _fake_driver(arch: int) -> None:
    """triton's active driver replaced by one that names the target and no device."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class NoDevice:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(NoDevice())


def check(args: argparse.Namespace) -> int:
    import torch
    import triton
    from triton.runtime.jit import JITFunction

    if triton.__version__ != args.triton:
        print(f"error: triton {triton.__version__} loaded, not {args.triton}", file=sys.stderr)
        return 2
    _fake_driver(args.arch)
    compiled: list[tuple[str, int, int, int]] = []

    def compile_only(self, grid):
        def launch(*a, **kw):
            k = self.run(*a, grid=grid, warmup=True, **kw)
            compiled.append((self.fn.__name__, k.metadata.shared, k.metadata.num_warps,
                             k.metadata.num_stages))  # fmt: skip
            return k

        return launch

    JITFunction.__getitem__ = compile_only  # type: ignore[method-assign]
    from pagedkv.model.triton import decode_tiles
    from pagedkv.model.triton.block_copy import copy_blocks
    from pagedkv.model.triton.decode import paged_decode
    from pagedkv.model.triton.kv_write import write_kv
    from pagedkv.model.triton.prefill import paged_prefill, prefill_tiles
    from pagedkv.model.triton.rms_norm import rms_norm
    from pagedkv.model.triton.rope_kv_write import rope_write_kv
    from pagedkv.model.triton.silu_mul import silu_mul

    # the compiled branch, not the interpreter's
    assert decode_tiles.pipeline_stages() == decode_tiles.NUM_STAGES
    assert not decode_tiles.upcast_dots(torch.bfloat16)
    failed: list[str] = []

    def attempt(label: str, fn, *a, **kw) -> None:
        t0, n = time.perf_counter(), len(compiled)
        try:
            fn(*a, **kw)
        except Exception as exc:  # a compile error: reported, the rest still compiled
            failed.append(label)
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
            return
        kernels = "; ".join(f"{name} smem {smem} B, {w} warps, {st} stages"
                            for name, smem, w, st in compiled[n:])  # fmt: skip
        print(f"ok   {label}: {kernels} ({time.perf_counter() - t0:.1f} s)", flush=True)

    heads = [(32, 8, 128), (9, 3, 64), (8, 2, 128)]  # Llama-3-8B, SmolLM2, a small GQA
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    z = torch.zeros
    for (hq, hkv, d), dt, bs in itertools.product(
        heads, (torch.bfloat16, torch.float32, torch.float16), block_sizes
    ):
        kc = z(max(4, 4096 // bs + 2), bs, hkv, d, dtype=dt)
        vc, bt, cl = torch.zeros_like(kc), z(3, 8, dtype=torch.int32), torch.full((3,), 5).int()
        q, rows = z(3, hq, d, dtype=dt), torch.arange(3, dtype=torch.int32)
        tag = f"{hq}/{hkv} heads of {d}, {str(dt)[6:]}, B={bs}"
        attention = (kc, vc, bt, cl, 0.1)
        attempt(f"decode one pass, {tag}", paged_decode, q, *attention)
        attempt(f"decode one pass, rows, {tag}", paged_decode, q, *attention, rows=rows)
        attempt(f"decode split, {tag}", paged_decode, q, *attention, num_splits=5)
        attempt(f"decode split, rows, {tag}", paged_decode, q, *attention, num_splits=33,
                rows=rows)  # fmt: skip
        starts = torch.tensor([0, 17, 39, 40], dtype=torch.int32)
        tiles = torch.tensor(prefill_tiles([0, 17, 39, 40], 16, 2), dtype=torch.int32)
        attempt(f"prefill, {tag}", paged_prefill, z(40, hq, d, dtype=dt), kc, vc, bt, cl, starts,
                tiles, 0.1, block_m=16)  # fmt: skip
        if dt == torch.float16:  # the engine runs bf16 and fp32 only; fp16 for attention alone
            continue
        k = z(3, hkv, d, dtype=dt)
        attempt(f"kv_write, {tag}", write_kv, k, k, kc, vc, torch.tensor([0, -1, 5]))
        attempt(f"block_copy, {tag}", copy_blocks, kc, torch.tensor([0, 1]), torch.tensor([2, 3]))
        attempt(
            f"block_copy, slot prefixes, {tag}",
            copy_blocks,
            kc,
            torch.tensor([0, 1]),
            torch.tensor([2, 3]),
            torch.tensor([1, 2]),
        )  # a partial prefix hit's copy
        qkv, cos = z(5, (hq + 2 * hkv) * d, dtype=dt), z(5, 1, d, dtype=dt)
        slots = torch.tensor([0, 1, -1, 3, 4])
        attempt(f"rope_kv_write, {tag}", rope_write_kv, qkv, cos, cos, kc, vc, slots, hq,
                in_place=True)  # fmt: skip
        attempt(f"rope_kv_write, int32 slots, {tag}", rope_write_kv, qkv, cos, cos, kc, vc,
                slots.int(), hq)  # fmt: skip
    for dt in (torch.bfloat16, torch.float32):
        for hidden, inter in ((576, 1536), (4096, 14336), (8192, 28672)):
            x, w, name = z(7, hidden, dtype=dt), z(hidden, dtype=dt), str(dt)[6:]
            attempt(f"rms_norm, hidden {hidden}, {name}", rms_norm, x, w, 1e-5)
            attempt(f"rms_norm + residual, hidden {hidden}, {name}", rms_norm, x, w, 1e-5,
                    x.clone())  # fmt: skip
            attempt(f"silu_mul, intermediate {inter}, {name}", silu_mul,
                    z(7, 2 * inter, dtype=dt))  # fmt: skip
    most = max((c[1] for c in compiled), default=0)
    print(f"\ntriton {triton.__version__}, sm_{args.arch}: {len(compiled)} compiles, "
          f"{len(failed)} failed; most shared memory {most} B")  # fmt: skip
    for label in failed:
        print(f"  failed: {label}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
