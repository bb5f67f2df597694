"""The pure-Python core must never reach for torch: import it with torch made unimportable."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

CORE_PACKAGES = ["pagedkv.kvcache", "pagedkv.sched", "pagedkv.planner", "pagedkv.sim"]

_BLOCK_AND_IMPORT = """
import importlib, pkgutil, sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test (imported as {name})")
        return None

sys.meta_path.insert(0, BlockTorch())
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
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
