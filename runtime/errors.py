"""Typed errors of the runtime package (attention errors live in runtime.attention.errors)."""


class RuntimeKVError(Exception):
    """Base class of the runtime's cache and engine errors."""


class CacheConfigError(RuntimeKVError, ValueError):
    """A cache configuration value is out of range (message names field, value and range)."""


class CacheStateError(RuntimeKVError, ValueError):
    """A cache was asked to do something its state forbids (unknown sequence, write past
    the memory the manager holds for it, swap data missing)."""


class MapperError(RuntimeKVError, RuntimeError):
    """The background mapper failed; the original error is chained."""


class PlanExecutionError(RuntimeKVError, RuntimeError):
    """Executing a memory plan failed part-way (a driver call, a copy, an out-of-memory).

    Raised only after the cache has undone the part of the plan it had applied: its mappings,
    page contents and swap space are as they were before ``execute``. ``rolled_back`` is False
    in the one case where undoing itself failed; the cache is then unusable (close it).
    ``op_index`` is the index in the plan of the op that failed (None if not known). The
    original error is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, op_index=None, rolled_back: bool = True) -> None:
        super().__init__(message)
        self.op_index = op_index
        self.rolled_back = rolled_back


class MapperPlanError(MapperError, PlanExecutionError):
    """A plan applied by the background mapper failed and was undone (both a MapperError and a
    PlanExecutionError, so callers of either keep working)."""


class CacheTooLargeError(CacheConfigError, MemoryError):
    """A cache asks for more memory than the device has (total), or than it has available now
    (host MemAvailable, CUDA free memory); raised before anything is allocated, the message
    gives both sizes in bytes."""


class NonFiniteKVError(RuntimeKVError, FloatingPointError):
    """K or V written to an 8-bit cache hold NaN or +-inf: int8 has no NaN (it stored code 0)
    and 8-bit codes saturate inf to the largest value, so the request went on with made-up
    tokens, and a first write's non-finite amax would fix the layer's scale for every later
    request. Raised before anything is stored or fixed (a tensor-parallel rank stores zeros
    instead and the ranks raise it together after the forward's collectives); the engine runs
    the step's requests one at a time and fails the one whose forward made it."""
