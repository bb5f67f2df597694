"""pagedkv's Triton kernels, one per file (paged decode, its split-K variant, ...).

Importing a kernel module imports ``triton``; this package itself imports nothing, so code that
never runs a kernel does not need triton installed.
"""
