"""The inference engine (torch): runner, sampler, and ``LLMEngine``."""

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.params import SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
