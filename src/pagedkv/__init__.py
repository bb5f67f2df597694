"""pagedkv: an LLM inference engine built around a paged KV cache.

The pure-Python core (``kvcache``, ``sched``, ``planner``, ``sim``) never imports torch; the
``model``, ``engine`` and ``server`` layers do. See README.md for the module map.

Importing pagedkv before torch sets ``GOMP_SPINCOUNT`` (``OPENMP_WAIT``) unless the user set it
or ``OMP_WAIT_POLICY``: libgomp's workers spin ~300k rounds waiting for each other before they
sleep, so beside another busy process every step waits on the preempted thread while its
partner spins (2 threads on 2 busy cores: 4x slower than quiet). 10k rounds kept the quiet
speed (0.99x) and ran 1.7x the default beside a CPU burner (benchmarks/bench_threads.py,
docs/latency.md). libgomp reads it once, when torch loads it: after ``import torch`` it is
too late, and nothing is set then.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

OPENMP_WAIT = {"GOMP_SPINCOUNT": "10000"}


def _default_openmp_wait(environ: dict[str, str] | _os._Environ, modules: dict) -> bool:
    """Set ``OPENMP_WAIT`` in ``environ`` where it still takes effect and the user chose
    nothing; whether it did."""
    if "torch" in modules or any(k in environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        return False
    environ.update(OPENMP_WAIT)
    return True


_default_openmp_wait(_os.environ, _sys.modules)
