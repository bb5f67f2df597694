"""Structured output: what a request's output must match (``spec.py``), pagedkv's JSON rules
(``json_schema.py``), the grammars llguidance compiles and their probe before admission
(``grammar.py``, ``probe.py``)."""
