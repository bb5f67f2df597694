"""pagedkv: an LLM inference engine built around a paged KV cache.

The pure-Python core (``kvcache``, ``sched``, ``planner``, ``sim``) never imports torch; the
``model``, ``engine`` and ``server`` layers do. See README.md for the module map.
"""

__version__ = "0.1.0"
