"""Memory policies by name: the four built in, or a manager class from the user's own code.

A custom policy is named ``module:Class`` (``mymodule:MyManager``, a dotted module importable
from the current directory or ``sys.path``) or ``path/to/file.py:Class``. The class must subclass
``vmemkv.scheduler.managers.base.MemoryManager`` (every abstract method, the guarantees in its
docstring) and is built as

    Class(model, cache_bytes, max_seq_len_tokens, block_size_tokens=..., page_bytes=...,
          layout=..., swap_bytes=...)

(``model`` a ``ModelSpec``, sizes in bytes and tokens; take ``**options`` to ignore the keywords
it does not use). Set ``holds_final_length = True`` on it when a sequence holds its final length
from admission (then the default watermark scope exempts it, as it does the reserve policies).
A policy file is one module per resolved path and content (the sha256 of its bytes): two files
named alike are two classes, and a file edited in a running session is loaded again when it is
next named.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Optional, Type

from .errors import ConfigError
from .managers import POLICIES
from .managers.base import MemoryManager


def is_custom(policy: str) -> bool:
    """Whether ``policy`` names a user class (``module:Class``) rather than a built-in."""
    return ":" in policy


def check_policy(policy: str) -> None:
    """ConfigError unless ``policy`` is a built-in name or a loadable ``module:Class``."""
    if is_custom(policy):
        load_policy_class(policy)
    elif policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)} or module:Class, "
                          f"got {policy!r}")


BUILT_WITH = ("model", "cache_bytes", "max_seq_len_tokens")   # its positional arguments


def check_constructor(spec: str, options: dict) -> None:
    """ConfigError, before anything is built, unless the class ``spec`` names can be built as
    ``Class(model, cache_bytes, max_seq_len_tokens, **options)``: it is abstract, or its
    constructor does not take these arguments. The message names the class and the call."""
    cls = load_policy_class(spec)
    if inspect.isabstract(cls):
        raise ConfigError(f"custom policy {spec!r}: {cls.__name__} is abstract: it does not "
                          f"implement {', '.join(sorted(cls.__abstractmethods__))}")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):      # no signature to read (a C type): building will tell
        return
    try:
        signature.bind(*BUILT_WITH, **options)
    except TypeError as error:
        raise ConfigError(f"custom policy {spec!r}: {cls.__name__} is built as "
                          f"{built_as(cls, options)} and its constructor does not take that "
                          f"({error}); take **options to ignore the keywords it does not use") from None


def built_as(cls: type, options: dict) -> str:
    """How a custom manager is called: ``Class(model, cache_bytes, ..., layout='per-layer')``."""
    return f"{cls.__name__}({', '.join(BUILT_WITH + tuple(f'{k}={v!r}' for k, v in options.items()))})"


def load_policy_class(spec: str) -> Type[MemoryManager]:
    """The ``MemoryManager`` subclass ``spec`` (``module:Class`` or ``file.py:Class``) names;
    ConfigError naming the module or class when it cannot be imported or is not a manager."""
    module_name, _, class_name = spec.rpartition(":")
    if not module_name or not class_name:
        raise ConfigError(f"custom policy {spec!r} must be module:Class or file.py:Class")
    module = _import(module_name, spec)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, MemoryManager)):
        raise ConfigError(f"custom policy {spec!r}: {module_name} has no MemoryManager subclass "
                          f"named {class_name!r}")
    return cls


def _import(module_name: str, spec: str):
    try:
        if module_name.endswith(".py"):
            return _import_file(module_name)
        if os.getcwd() not in sys.path:       # console scripts do not put the cwd on sys.path
            sys.path.append(os.getcwd())
        return importlib.import_module(module_name)
    except (ImportError, OSError) as error:
        raise ConfigError(f"custom policy {spec!r}: cannot import {module_name}: {error}") from None
    except SyntaxError as error:
        raise ConfigError(f"custom policy {spec!r}: {module_name} has a syntax error at "
                          f"{error.filename}:{error.lineno}: {error.msg}") from None
    except (Exception, SystemExit) as error:   # noqa: BLE001 -- the user's module raised
        # SystemExit too: a script's argparse at module level read vmemkv's own argv, and its
        # "usage: vmemkv [--lr LR] ... unrecognized arguments: simulate" was all that was said
        raise ConfigError(f"custom policy {spec!r}: importing {module_name} raised "
                          f"{type(error).__name__}: {error}") from None


def policy_file(spec: str) -> Optional[str]:
    """The resolved path of the file a ``file.py:Class`` spec names, None for a built-in or a
    ``module:Class`` (nothing is loaded or read)."""
    module_name = spec.rpartition(":")[0]
    return os.path.realpath(module_name) if module_name.endswith(".py") else None


def _import_file(path: str):
    """The module of the policy file ``path``, keyed in ``sys.modules`` by its resolved path
    and the sha256 of its bytes: two files with one basename (``v1/policy.py``,
    ``v2/policy.py``) are two modules, and a file edited since it was loaded is loaded again
    (the old key was the basename alone: both ran the first one loaded, silently). The module
    runs the very bytes that were hashed (no bytecode cache: it is keyed by mtime, which an
    edit within a second can leave unchanged)."""
    resolved = os.path.realpath(path)
    if not os.path.isfile(resolved):
        raise ImportError(f"no file {path}")
    with open(resolved, "rb") as f:
        source = f.read()
    identity = hashlib.sha256(resolved.encode() + b"\0" + source).hexdigest()[:16]
    name = f"vmemkv_user_policy_{os.path.splitext(os.path.basename(resolved))[0]}_{identity}"
    if name in sys.modules:
        return sys.modules[name]
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, resolved))
    sys.modules[name] = module
    try:
        exec(compile(source, resolved, "exec"), module.__dict__)   # noqa: S102 -- the user's policy
    except BaseException:
        del sys.modules[name]      # a failed import is not cached: fixing the file is enough
        raise
    return module
