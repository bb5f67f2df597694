"""The pure-Python core must never reach for torch: import it with torch made unimportable."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

CORE_PACKAGES = [
    "pagedkv.errors",
    "pagedkv.units",
    "pagedkv.untrusted",
    "pagedkv.breaker",
    "pagedkv.urls",
    "pagedkv.placement",
    "pagedkv.pages",
    "pagedkv.traces",
    "pagedkv.kvcache",
    "pagedkv.sched",
    "pagedkv.planner",
    "pagedkv.sim",
    "pagedkv.kvstore",
    "pagedkv.routing",
    "pagedkv.router",  # a router process never needs torch (2.5 s and 220 MB at start-up)
]

_BLOCK_AND_IMPORT = """
import importlib, pkgutil, sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test (imported as {name})")
        return None

sys.meta_path.insert(0, BlockTorch())
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(getattr(package, "__path__", []), package.__name__ + "."):
    importlib.import_module(info.name)
assert "torch" not in sys.modules
print("ok")
"""


@pytest.mark.parametrize("package", CORE_PACKAGES)
def test_core_imports_without_torch(package):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} does not exist yet")
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_AND_IMPORT, package],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_blocker_really_blocks():
    """The guard itself must fail when a module imports torch (or this test proves nothing)."""
    code = _BLOCK_AND_IMPORT.replace("package = importlib", "import torch\npackage = importlib")
    result = subprocess.run(
        [sys.executable, "-c", code, "pagedkv.kvcache"], capture_output=True, text=True
    )
    assert result.returncode != 0 and "torch is blocked" in result.stderr


def _import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the pagedkv modules it imports (anywhere in the file: lazy imports inside
    functions included, and ``if TYPE_CHECKING:`` imports unless ``type_checking`` is False:
    a circle a type checker walks is a circle all the same), read from the source with
    ``ast``."""
    import ast
    from pathlib import Path

    import pagedkv

    root = Path(pagedkv.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):  # imports only for type checkers never run
            if (
                not type_checking
                and isinstance(node, ast.If)
                and ast.unparse(node.test).endswith("TYPE_CHECKING")
            ):
                node.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        graph[module] = targets
    return {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles found by a depth-first walk of ``edges``."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles


def test_no_import_circles():
    """Imports flow one way: no module reaches itself through the modules it imports (a
    package's ``__init__`` importing its own submodules is the one allowed loop)."""
    graph = _import_graph()
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    cycles = _cycles(edges)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_page_facts_import_nothing_above_them():
    """``pagedkv.pages`` sits below the planner, the model, the store and the router: it may
    import only itself, ``errors`` and ``units``."""
    allowed = ("pagedkv.pages", "pagedkv.errors", "pagedkv.units")
    graph = _import_graph()
    upward = {
        f"{m} -> {t}"
        for m, ts in graph.items()
        if m == "pagedkv.pages" or m.startswith("pagedkv.pages.")
        for t in ts
        if t != "pagedkv" and not t.startswith(allowed)
    }
    assert not upward, "pages imports above itself: " + "; ".join(sorted(upward))


def test_the_circle_check_sees_real_imports_and_finds_circles():
    graph = _import_graph()
    assert "pagedkv.errors" in graph["pagedkv.cli"]  # the graph sees real imports
    # ... imports inside functions (the command's lazy import of its engine) ...
    assert "pagedkv.commands.profile_timeline" in graph["pagedkv.commands.profile"]
    # ... and ``if TYPE_CHECKING:`` ones, which a type checker walks (issue 54's circles hid
    # there: the step loop and the engine, the layer and the backends).
    typed = "pagedkv.model.layers"
    assert typed in graph["pagedkv.model.triton.attention"]
    assert typed not in _import_graph(type_checking=False)["pagedkv.model.triton.attention"]
    # The first version's circle, as it was: layout imported gguf_meta lazily, and back.
    edges = {"pages.layout": {"pages.gguf_header"}, "pages.gguf_header": {"pages.layout"}}
    assert _cycles(edges) == [["pages.gguf_header", "pages.layout", "pages.gguf_header"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# docs/architecture.md's layer picture, bottom first: a package may import only packages of the layers
# below its own (never a sibling). ``pagedkv`` is the root package (``__version__`` only).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pagedkv", "errors"),
    ("units", "background", "lazy", "breaker", "urls", "untrusted", "placement", "cpu_share"),
    ("traces", "kvcache", "pages"),
    ("routing", "sched", "planner"),
    ("sim", "kvstore"),
    ("model",),
    ("engine",),
    ("disagg",),
    ("server",),
    ("router",),
    ("serve_ray",),  # replicas on Ray Serve: above the server and the router it reuses
    ("commands",),
    ("cli",),
    ("__main__",),
)
# What the layers allow but the design does not. The simulator replaces the model by a clock
# and drives the core itself: only the commands run it (the engine reaching into it for a
# step's shape was the first violation). A router never builds an engine nor pairs P/D.
NEVER: dict[str, frozenset[str]] = {
    "model": frozenset({"sim"}),
    "engine": frozenset({"sim"}),
    "disagg": frozenset({"sim"}),
    "server": frozenset({"sim"}),
    "router": frozenset({"sim", "engine", "disagg"}),
    "serve_ray": frozenset({"sim"}),
}
MAY_IMPORT: dict[str, frozenset[str]] = {
    package: frozenset(p for lower in LAYERS[:i] for p in lower) - NEVER.get(package, frozenset())
    for i, layer in enumerate(LAYERS)
    for package in layer
}


def _top(module: str) -> str:
    """The top-level package of a module: ``pagedkv.engine.kv.mover`` -> ``engine``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``module -> target`` for every import of ``graph`` that ``MAY_IMPORT`` does not allow."""
    return sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        for t in ts
        if _top(t) != _top(m) and _top(t) not in MAY_IMPORT.get(_top(m), frozenset())
    )


def test_the_layer_table_names_every_package_once():
    names = [p for layer in LAYERS for p in layer]
    assert len(names) == len(set(names)), "a package sits in two layers"
    assert set(names) == {_top(m) for m in _import_graph()}, "add the new package to LAYERS"


def test_imports_follow_the_layers():
    violations = _layer_violations(_import_graph())
    assert not violations, "imports against docs/architecture.md's layers: " + "; ".join(violations)


def test_the_layer_check_catches_a_violation():
    legal = {"pagedkv.engine.runner": {"pagedkv.kvcache.paged", "pagedkv.engine.kv"}}
    assert _layer_violations(legal) == []
    # The violation this check was written after, and one of each kind the table forbids.
    fake = {
        "pagedkv.engine.profiling": {"pagedkv.sim.cost_model"},  # layered, but never
        "pagedkv.kvcache.paged": {"pagedkv.sched.sequence"},  # upward
        "pagedkv.sim.replica": {"pagedkv.kvstore.tier"},  # sideways, same layer
        "pagedkv.router.app": {"pagedkv.engine"},  # a router builds no engine
    }
    assert _layer_violations(fake) == sorted(f"{m} -> {t}" for m, ts in fake.items() for t in ts)
