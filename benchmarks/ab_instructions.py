"""Instructions a decode token costs at two revisions, counted by valgrind: the deterministic
half of "is the CPU path unchanged in speed?" (``ab_revisions.py`` times it, on a machine
whose load moves the times by more than the 3 % asked).

Each revision runs in a git worktree of its own under valgrind's callgrind, one torch thread,
the embedded SmolLM2-135M in fp32 generating from one 27-token prompt twice: ``--tokens`` short
and long. The difference of the two runs' instruction counts over the difference in tokens is
the decode step's count (the weights' load and the prefill cancel out). It also checks both
revisions drew the same ids. Slow: about 7 minutes a run on a 2-core Xeon. Nothing asserted.

    python benchmarks/ab_instructions.py BASE HEAD [--tokens 4 12]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = [1, 504, 3240, 314, 4233, 282, 1345, 30, 198] * 3

CHILD = """
import sys, torch
sys.path.insert(0, {src!r})
torch.set_num_threads(1)
import pagedkv
assert pagedkv.__file__.startswith({src!r}), pagedkv.__file__
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig(log_startup=False, max_model_len=512, adapt_threads=False))
out = engine.generate([{prompt!r}], SamplingParams(max_tokens={tokens}, ignore_eos=True))
print("ids", out[0].outputs[0].token_ids)
"""


def count(tree: Path, tokens: int, scratch: Path) -> tuple[int, str]:
    """Instructions of one run at ``tree`` generating ``tokens`` tokens, and its ids line."""
    script = CHILD.format(src=str(tree / "src"), prompt=PROMPT, tokens=tokens)
    out_file = scratch / f"callgrind.{tree.name}.{tokens}"
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}"]
        + [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
    )
    collected = re.search(r"Collected : (\d+)", run.stderr)
    ids = next(ln for ln in run.stdout.splitlines() if ln.startswith("ids"))
    if collected is None:
        raise SystemExit(f"error: valgrind printed no count for {tree}")
    return int(collected.group(1)), ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base")
    parser.add_argument("head")
    parser.add_argument("--tokens", type=int, nargs=2, default=(4, 12))
    args = parser.parse_args()
    short, long = sorted(args.tokens)
    if short < 1 or long == short:
        raise SystemExit("error: --tokens needs two different counts >= 1")
    per_token = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("base", "head"):
            tree = Path(scratch) / name
            rev = getattr(args, name)
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev],
                check=True,
            )
            try:
                (n_short, _), (n_long, ids) = (count(tree, t, Path(scratch)) for t in (short, long))
            finally:
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True
                )
            per_token[name] = (n_long - n_short) / (long - short)
            print(
                f"{name} {rev}: {n_short:,} / {n_long:,} instructions; {per_token[name] / 1e6:.2f} M a token; {ids}"
            )
    print(f"head / base: {per_token['head'] / per_token['base']:.4f}")


if __name__ == "__main__":
    main()
