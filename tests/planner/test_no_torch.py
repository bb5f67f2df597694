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


def test_planner_modules_import_each_other_without_a_circle():
    """Every import between planner modules, deferred ones inside functions included: the first
    version hid a circle (layout -> gguf_meta -> layout) behind a function-level import."""
    import ast
    from pathlib import Path

    import pagedkv.planner

    folder = Path(pagedkv.planner.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["pagedkv", "planner"] and len(parts) > 2:
                    deps.add(parts[2])
    graph.pop("__init__", None)

    def visit(module: str, stack: list[str]) -> None:
        assert module not in stack, f"import circle: {' -> '.join([*stack, module])}"
        for dep in sorted(graph.get(module, ())):
            visit(dep, [*stack, module])

    for module in graph:
        visit(module, [])
