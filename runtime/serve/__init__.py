"""``vmemkv serve``: the engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn, the
optional extra ``serve``), and the client side of ``vmemkv bench serve``.

    from vmemkv.runtime.serve import Server
    with Server(engine, "tiny-llama", port=0).start() as server:
        ...   # POST server.url + "/v1/completions"
"""
from .errors import (ApiError, EngineAsleepError, KeyAtLimitError, ServeConfigError,
                     ServeError, ServerOverloadedError)
from .server import Server

__all__ = ["ApiError", "EngineAsleepError", "KeyAtLimitError", "Server", "ServeConfigError",
           "ServeError", "ServerOverloadedError"]
