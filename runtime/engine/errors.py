"""Typed errors of the engine: everything a user can trigger is a ValueError subclass."""
from ..errors import RuntimeKVError


class EngineError(RuntimeKVError):
    """Base class of the engine's errors."""


class EngineConfigError(EngineError, ValueError):
    """An engine setting is out of range (the message names the field, the value and the range)."""


class RequestRejectedError(EngineError, ValueError):
    """A request was refused at submission (it could never fit, or its prompt or parameters are
    invalid); it holds no memory and nothing of it runs. ``index`` is its position in the
    submitted batch, ``field`` the request field at fault (the server's 400 names it)."""

    def __init__(self, message: str, index: int = 0, field: str = "prompt") -> None:
        super().__init__(message)
        self.index, self.field = index, field


class UnknownAdapterError(RequestRejectedError):
    """A request's ``SamplingParams.lora`` names no loaded adapter (field "lora"; the server's
    404: the request's ``model`` is not served, perhaps unloaded since it was checked). An
    adapter that is loaded but leaves the request too little room is a RequestRejectedError."""


class CacheShrunkRequestError(RequestRejectedError):
    """A request that fits the KV cache at ``max_cache_bytes`` but not at the size
    ``resize_cache`` left it: refused (nothing queued) until the cache is resized up (the
    server's 503 + Retry-After, where a request that can never fit is a 400)."""


class NonFiniteLogitsError(EngineError, FloatingPointError):
    """The model's logits for a sequence hold NaN or +inf (or are all -inf): no token can be
    chosen from them. The engine runs the step's rows one at a time to fail the request(s)
    they belong to (``RequestOutput.error``); the others go on."""


class LogitsShapeError(EngineError, RuntimeError):
    """The model's forward returned logits the engine cannot sample from exactly: not floating
    point, or not of shape (1, rows kept, vocab_size) (the message names the expected and the
    actual). The model's fault, handled as a forward that raised: the step's sequences are run
    one at a time and the request(s) whose forward fails alone end "failed"."""


class EngineClosedError(EngineError, RuntimeError):
    """The engine was used after ``close()`` (``add_request``): its cache is released; nothing
    is queued. Also raised by a batch call (``generate``, ``stream``, ``run_until_done``) whose
    requests ``close()`` ended "aborted" while it ran (``request_ids``: the call's requests)."""


class UnknownRequestError(EngineError, KeyError):
    """A request id the engine does not know: never returned by ``add_request``, or its output
    was already collected with ``output(..., pop=True)``. Nothing changes."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RequestEndedError(EngineError, ValueError):
    """``abort`` of a request that has already ended (finished, aborted or failed); the message
    names the id and its status. Nothing changes."""

class TensorParallelConfigError(EngineConfigError):
    """A ``tensor_parallel_size`` (or the model it would shard) that cannot run exactly: 0, more
    than the attention heads, not dividing the heads or the MLP width, a model whose layers we
    cannot shard. Raised before any process starts or any memory is built."""


class TensorParallelError(EngineError, RuntimeError):
    """A rank died, hung past ``tp_timeout_s`` or failed; raised on every surviving process. The
    engine is closed: every rank's memory is released and no worker process is left."""


class TensorParallelMismatchError(TensorParallelError):
    """At construction, the ranks' sharded forward differed from the unsharded model on rank 0
    by more than the self-check allows (the message names the largest difference and the
    limit): the engine refused to serve and has stopped every rank and freed their memory."""


class BeamSearchParamsError(EngineConfigError):
    """A ``BeamSearchParams`` field out of range, or a beam search this engine cannot run
    exactly (temperature sampling, more beams than a step runs or than the vocabulary ranks);
    ``field`` names it (the server's 400 does). Raised before anything is queued or built."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class EngineSleepingError(EngineError, RuntimeError):
    """The engine is asleep (``Engine.sleep``): its KV memory is given back; ``wake()`` it
    first. Requests added meanwhile wait."""


class EngineBusyError(EngineError, RuntimeError):
    """A thread called a state-changing method (``step``, ``generate``, ``abort``, ``close``,
    ...) while another thread was inside one: an engine is single-threaded, driven from one
    thread at a time (as the server's EngineThread does). The message names the call; nothing
    changed. The thread inside a call may call back in (an ``on_token`` callback may)."""
