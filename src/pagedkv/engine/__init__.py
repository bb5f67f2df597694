"""The inference engine (torch): runner, sampler, and ``LLMEngine``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_attributes

# Names resolved on first use (PEP 562), so that importing one torch-free module of this
# package (a router reads the request models and error shapes) does not import torch.
_LAZY = {
    "EngineConfig": "pagedkv.engine.config",
    "LLMEngine": "pagedkv.engine.engine",
    "CompletionOutput": "pagedkv.engine.outputs",
    "RequestOutput": "pagedkv.engine.outputs",
    "SamplingParams": "pagedkv.engine.params",
}

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.engine.outputs import CompletionOutput, RequestOutput
    from pagedkv.engine.params import SamplingParams

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
