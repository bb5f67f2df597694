"""Page and model facts: what a model's KV looks like and what a page of it means.

This package owns, once each: a model's shape and where it is read from (``shape``,
``sources``: presets, ``config.json``, GGUF headers), the GGUF header reader
(``gguf_header``), the KV storage formats (``kv_dtypes``), the KV record layout with its
record and block byte counts (``layout``: every other place asks ``KVLayout``), and the page
format with the one rule for whether two of them match (``page_format``).

Pure Python: it imports no torch, numpy or other heavy library, and nothing above it (only
``pagedkv.errors`` and ``pagedkv.units``); the planner, the model, the store, the router, the
P/D pair and the simulator all build on it.
"""
