"""One module per CLI command. Each exposes ``register(subparsers)``; the parser it adds sets
``func`` to a callable ``(args) -> int``. Heavy imports (torch, matplotlib) stay inside ``func``
so that ``pagedkv --help`` and the pure-Python commands start fast."""
