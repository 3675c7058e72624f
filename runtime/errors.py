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
