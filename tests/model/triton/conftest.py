"""Triton kernel tests run on CPU tensors under the Triton interpreter.

triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is decorated, so it is set
here, at import, before any test module imports a kernel. ``setdefault``: a GPU run may export
``TRITON_INTERPRET=0`` to compile the kernels for real.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
