"""The planner is pure Python: it imports and plans with torch (and matplotlib) blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"torch", "matplotlib", "numpy"}:
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, Block())
    import pkgutil, pagedkv.planner
    for mod in pkgutil.iter_modules(pagedkv.planner.__path__):
        __import__(f"pagedkv.planner.{mod.name}")
    import pagedkv.commands.plan
    from pagedkv.cli import main
    code = main(["plan", "--model", "llama-3-8b", "--num-seqs", "8", "--max-len", "1024", "--json"])
    assert code == 0
    assert not any(m.split(".")[0] in {"torch", "matplotlib", "numpy"} for m in sys.modules)
    """
)


def test_planner_runs_without_torch():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert '"block_size"' in result.stdout
