"""Prefill/decode disaggregation: two ``pagedkv serve`` processes that split a request.

The prefill instance computes prompts and its KV store tier writes their full blocks to the
shared store; the decode instance asks it to prefill each prompt, then admits the request
itself, and its store tier loads those blocks instead of recomputing them. The two must agree
on what a KV page means (``pages.page_format.PageFormat``): ``handshake`` compares them at
start-up and refuses to start on a mismatch; ``relayout`` re-pages blocks between block sizes
when the decode side asks for it (``--kv-import relayout``).
"""

from pagedkv.disagg.config import KV_IMPORT_MODES, ROLES, PDConfig

__all__ = ["KV_IMPORT_MODES", "PDConfig", "ROLES"]
