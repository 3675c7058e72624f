"""Typed errors of the attention package. Everything a caller can trigger raises one of these.

    AttentionError
     ├── UnknownBackendError      name not in the registry (message lists the known names)
     ├── BackendUnavailableError  registered, but cannot run here (message says why)
     ├── UnsupportedError         backend cannot run this cache kind / device / dtype / config
     └── AttentionShapeError      tensors disagree (message names the shapes)
"""
from __future__ import annotations


class AttentionError(Exception):
    """Base class of every error raised by ``runtime.attention``."""


class UnknownBackendError(AttentionError, KeyError):
    """No backend is registered under this name."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name, self.known = name, known
        super().__init__(f"unknown attention backend {name!r}; known backends: {', '.join(known)}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class BackendUnavailableError(AttentionError):
    """The backend is registered but cannot run in this process (missing package, no GPU...)."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason
        super().__init__(f"attention backend {name!r} is unavailable: {reason}")


class UnsupportedError(AttentionError, ValueError):
    """The backend does not support this cache kind, device, dtype or configuration."""


class AttentionShapeError(AttentionError, ValueError):
    """Query, cache and metadata tensors do not fit together; the message names the shapes."""
