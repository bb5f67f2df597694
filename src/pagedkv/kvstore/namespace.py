"""The store namespace: which engines may read each other's blocks.

Two engines share a key only if a block of one is exactly the bytes the other would compute:
same page format (``pages.page_format.PageFormat``), same model (``model_id``: the engine's digest of
its weights, see ``engine/kv/identity.py``) and same block-hash function (the
chain hash differs between them anyway; naming it keeps the namespace self-describing).
"""

from __future__ import annotations

import hashlib
import json

from pagedkv.kvstore.codec import NAMESPACE_BYTES
from pagedkv.pages.page_format import PageFormat


def store_namespace(page_format: PageFormat, model_id: str, hash_algorithm: str) -> bytes:
    """``NAMESPACE_BYTES`` bytes: blake2b of the page format, model identity and hash name."""
    doc = {"page_format": page_format.to_dict(), "model": model_id, "hash": hash_algorithm}
    text = json.dumps(doc, sort_keys=True).encode()
    return hashlib.blake2b(text, digest_size=NAMESPACE_BYTES).digest()
