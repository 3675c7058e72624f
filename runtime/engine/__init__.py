"""The continuous-batching engine: an HF causal LM, the scheduler, and a vmem or paged cache.

    from vmemkv.runtime.engine import Engine, SamplingParams
    engine = Engine(model, cache="vmem", layout="per-layer", max_batch=16)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=32))

Modules: config (EngineConfig), engine (Engine), model_runner (one packed step through the
model), sampling (SamplingParams, Sampler), outputs (TokenEvent, RequestOutput, EngineStats),
errors (EngineError, EngineConfigError, RequestRejectedError).
"""
from .config import EngineConfig
from .engine import Engine
from .errors import EngineConfigError, EngineError, RequestRejectedError
from .outputs import CompletionOutput, EngineStats, RequestOutput, TokenEvent
from .sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "TokenEvent", "EngineStats", "EngineError", "EngineConfigError", "RequestRejectedError"]
