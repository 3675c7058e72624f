"""Typed errors of the scheduler package.

Every error a user can trigger (a bad config value, a request that can never fit, an unknown
sequence id, freeing twice) is one of these, with a message that names the value and the limit.
Operations that raise leave all state exactly as it was.
"""


class SchedulerError(Exception):
    """Base class of every error raised by ``scheduler``."""


class ConfigError(SchedulerError, ValueError):
    """A configuration value is out of its allowed range (message names field, value, range)."""


class PolicyError(SchedulerError, ValueError):
    """A custom memory policy (``module:Class``, ``file.py:Class``) failed while it was built
    or run: it raised, or it broke the manager interface (kept memory its ``free`` should
    have released). The message names the spec, the method and the exception (type, message,
    file:line in the policy's code). Not a ConfigError: the configuration was valid (a sweep
    refuses its grid on a ConfigError, while a policy failing at one point fails that point's
    row alone); a ValueError, so the command line prints it as one line (exit 2)."""


class RequestTooLargeError(SchedulerError, ValueError):
    """A request can never fit: longer than the maximum length or the whole cache.
    ``request_id``: the request a step found an empty cache cannot admit (a beam group that
    must come back into private memory), so a caller can end it alone; None where the
    request was refused at submission, or for a manager's call. ``field``: the Request field
    a submission refusal asks to change ("prompt_len" when the prompt alone is too long,
    "max_tokens", "adapter", "beam_width"; None: not said)."""

    def __init__(self, message: str = "", request_id=None, field=None) -> None:
        super().__init__(message)
        self.request_id, self.field = request_id, field

    def __reduce__(self):
        return type(self), (str(self), self.request_id, self.field)


def length_field(prompt_tokens: int, limit_tokens: int) -> str:
    """The field a request past ``limit_tokens`` must change: its prompt when the prompt with
    one new token does not fit, else max_tokens."""
    return "prompt_len" if prompt_tokens >= limit_tokens else "max_tokens"


class CacheShrunkError(RequestTooLargeError):
    """A request fits the pool at its largest (``max_cache_bytes``) but not at the size it was
    resized down to: it can be admitted once the pool grows again."""


class UnknownSequenceError(SchedulerError, KeyError):
    """A sequence id the manager or scheduler does not hold (never added, or already freed)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(SchedulerError, ValueError):
    """A sequence id that is already held was allocated or submitted again."""


class OutOfCapacityError(SchedulerError, MemoryError):
    """An allocation was asked for without room; ``can_*`` should have been asked first."""


class SwapSpaceExhaustedError(SchedulerError, MemoryError):
    """Swapping out would exceed the host swap space."""


class SlotError(SchedulerError, ValueError):
    """An explicit vmem slot is outside the manager's slots or already holds a sequence."""


class TransactionStateError(SchedulerError, RuntimeError):
    """A manager's ``begin`` inside an open transaction, or ``commit``/``rollback`` without one."""
class UnknownRequestError(UnknownSequenceError):
    """A request id with no unfinished sequence: never submitted, or already ended."""


class CacheResizeError(SchedulerError, MemoryError):
    """A cache resize that cannot be done as asked: the bytes running sequences hold (and
    ``preempt`` was not given), a request that would no longer fit, or past the pool's
    ``max_cache_bytes``. Nothing changed."""
