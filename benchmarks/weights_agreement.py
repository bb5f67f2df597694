"""``--weights int4`` against fp32 on the trace workload, once per form of pagedkv's native
microkernel (``native.ISAS``; the ones this CPU has), and the kernel choice on repeated starts
(issue 28: int4's greedy tokens equal fp32's on all 64 requests, on an AVX2 and an AVX-512
path alike, and the same choice on five consecutive starts).

Every run is a fresh process (``engine_peers.run_job_pagedkv``) with ``PAGEDKV_NATIVE_ISA``
set: fp32 once, int4 once with the trace, then int4 loaded ``--starts - 1`` more times, its
start-up report (``weights_report``: which kernel each shape runs) compared with the first.
Prints a markdown table and writes ``--out``. Nothing is asserted; the tests assert the same
property on tiny models (``test_native/quant.py``).

    python benchmarks/weights_agreement.py [--requests 64] [--starts 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from common import finish_meta, machine_meta, write_json
from engine_peers import run_job_pagedkv
from engine_vllm_cpu import agreement
from engine_workloads import azure_workload
from pagedkv.model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/weights_agreement.json"))
    args = parser.parse_args()
    meta = machine_meta()
    ids, outs = azure_workload(args.requests, load_model(None, progress=False)[2].vocab_size)
    trace = {"trace": {"prompts": ids, "max_tokens": outs}}
    isas = ["avx2"] + (["avx512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])
    rows = {}
    for isa in isas:
        os.environ["PAGEDKV_NATIVE_ISA"] = isa  # read by the spawned child's native.kernels()
        job = {"threads": args.threads, "sections": trace}
        fp32 = run_job_pagedkv({**job, "weights": "float"})
        int4 = run_job_pagedkv({**job, "weights": "int4"})
        reports = [int4["weights_report"]]
        for _ in range(args.starts - 1):
            reports.append(
                run_job_pagedkv({**job, "weights": "int4", "sections": {}})["weights_report"]
            )
        rows[isa] = {
            "agreement": agreement(int4["sections"]["trace"]["token_ids"],
                                   fp32["sections"]["trace"]["token_ids"]),
            "seconds": {"float": fp32["sections"]["trace"]["seconds"],
                        "int4": int4["sections"]["trace"]["seconds"]},
            "same_choice_every_start": all(r == reports[0] for r in reports),
            "starts": len(reports), "weights_report": reports[0],
        }  # fmt: skip
        print(f"{isa}: {rows[isa]['agreement']}, same choice on {len(reports)} starts: "
              f"{rows[isa]['same_choice_every_start']}", flush=True)  # fmt: skip
    print(f"\n| native ISA | int4 = fp32 (requests) | same kernel choice, {args.starts} starts "
          "| fp32 s | int4 s |\n|---|---:|---|---:|---:|")  # fmt: skip
    for isa, r in rows.items():
        a = r["agreement"]
        print(
            f"| {isa} | {a['identical']}/{a['requests']} | {r['same_choice_every_start']} | "
            f"{r['seconds']['float']:.1f} | {r['seconds']['int4']:.1f} |"
        )
    write_json(args.out, {"meta": finish_meta(meta), "requests": args.requests, "isas": rows})


if __name__ == "__main__":
    main()
