"""The continuous-batching engine: an HF causal LM, the scheduler, and a vmem or paged cache.

    from vmemkv.runtime.engine import Engine, SamplingParams
    engine = Engine(model, cache="vmem", layout="per-layer", max_batch=16)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=32))
    beams = engine.beam_search(prompts, BeamSearchParams(beam_width=4, max_new_tokens=32))

Modules: config (EngineConfig), engine (Engine), model_runner (one packed step through the
model), sampling (SamplingParams, Sampler), outputs (TokenEvent, RequestOutput, EngineStats),
errors (EngineError, EngineConfigError, RequestRejectedError, CacheShrunkRequestError,
UnknownAdapterError,
EngineClosedError, EngineBusyError: another thread's call), beam (beam search: BeamSearchParams).
"""
from .beam_params import BeamSearchParams
from .config import EngineConfig
from .engine import Engine
from .errors import (BeamSearchParamsError, CacheShrunkRequestError, EngineBusyError,
                     EngineClosedError, EngineConfigError, EngineError, RequestRejectedError,
                     UnknownAdapterError)
from .outputs import CompletionOutput, EngineStats, RequestOutput, TokenEvent
from .sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "BeamSearchParams", "BeamSearchParamsError", "RequestOutput", "CompletionOutput",
           "TokenEvent", "EngineStats", "EngineError", "EngineConfigError", "RequestRejectedError",
           "CacheShrunkRequestError", "UnknownAdapterError", "EngineClosedError", "EngineBusyError"]
