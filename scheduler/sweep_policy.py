"""What a sweep keys a custom policy's points by: its file's resolved path and the sha256 of its
bytes (``POLICY_ID``), for a ``file.py:Class`` and a ``module:Class`` alike, so ``--resume``
runs again the points of a policy whose code changed and keeps those of one that did not.

A ``module:Class`` is keyed by its module's own file (the one ``importlib`` finds for the name;
not the modules it imports, as a policy file is keyed by itself alone) and runs the very bytes
that were hashed: the sweep executes that file into ``sys.modules[module]`` whenever the bytes
differ from the ones it last ran there (a module imported before, by the sweep of an earlier
call or by the user, once edited, kept running its old code in that Python process, and the
bytecode cache is keyed by mtime and size, which an edit can leave unchanged). A module that
has no Python source file (built in memory, an extension) cannot be keyed by content and is
refused by name.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import BinaryIO, Dict, Tuple

from .errors import ConfigError
from .policies import is_custom, load_policy_class, policy_file

POLICY_ID = ("policy_path", "policy_sha256")   # a custom policy's file, in its key and its row

_RUNNING: Dict[str, str] = {}   # module name -> sha256 of the bytes this process ran there


def sha256_of(f: BinaryIO, chunk_bytes: int = 2**20) -> str:
    """The hex sha256 of the rest of the open binary file ``f``, read ``chunk_bytes`` at a
    time (``hashlib.file_digest`` is Python 3.11+; this package supports 3.10)."""
    digest = hashlib.sha256()
    while chunk := f.read(chunk_bytes):
        digest.update(chunk)
    return digest.hexdigest()


def policy_id(policy: str) -> dict:
    """The ``POLICY_ID`` of a custom policy: its file's resolved path and the sha256 of its
    bytes (a ``file.py:Class``: ``policies`` keys the module it loads by the same path and
    bytes; a ``module:Class``: the module now runs these bytes, ``_run_module``); None for a
    built-in. ConfigError naming the policy when its file cannot be found or read."""
    if not is_custom(policy):
        return dict.fromkeys(POLICY_ID)
    path = policy_file(policy)
    if path is not None:
        return {"policy_path": path,
                "policy_sha256": hashlib.sha256(_read(policy, path)).hexdigest()}
    path, digest = _run_module(policy)
    return {"policy_path": path, "policy_sha256": digest}


def _read(policy: str, path: str) -> bytes:
    """The bytes of ``policy``'s file (a policy's source: small); ConfigError naming it when
    it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:
        raise ConfigError(f"custom policy {policy!r}: cannot read {path}: "
                          f"{error.strerror or error}") from None


def check_policy_unchanged(point: dict) -> None:
    """ConfigError when the point was keyed by its policy file's sha256 (``check_point``) and
    the file has changed since: the point would run code its row does not name (an edit while
    the sweep runs). ``--resume`` runs it again with the file as it is then."""
    keyed = point.get("policy_sha256")
    if keyed is None:            # a built-in policy, or a point not yet keyed
        return
    now = policy_id(point["policy"])["policy_sha256"]
    if now != keyed:
        raise ConfigError(f"custom policy {point['policy']!r}: {point['policy_path']} changed "
                          f"since the sweep read it (sha256 {keyed[:12]}..., now {now[:12]}...): "
                          f"this point would run code its row does not name; run it again "
                          f"(--resume runs the points whose policy changed)")


def _run_module(policy: str) -> Tuple[str, str]:
    """(resolved path, sha256) of the source file of the module ``policy`` (``module:Class``)
    names, which ``sys.modules`` then holds as executed from exactly those bytes."""
    name = policy.rpartition(":")[0]
    spec = _find(name)
    origin = spec.origin if spec is not None and spec.has_location else None
    if origin is None or not origin.endswith(".py") or not os.path.isfile(origin):
        if spec is None:
            load_policy_class(policy)  # its ConfigError names why the module cannot be imported
        raise ConfigError(f"custom policy {policy!r}: module {name} has no Python source file "
                          f"({origin or 'none'}) whose bytes a sweep could key its rows by "
                          f"(--resume would keep the rows of an edited one); put the class in "
                          f"a .py file")
    path = os.path.realpath(origin)
    source = _read(policy, path)
    digest = hashlib.sha256(source).hexdigest()
    if name not in sys.modules or _RUNNING.get(name) != digest:
        _execute(policy, spec, source)
        _RUNNING[name] = digest
    return path, digest


def _find(name: str):
    """The module spec of ``name`` (None when it is not found, its package fails to import or
    it is a module with no spec, built in memory), looked up as ``policies`` imports it: the
    current directory on ``sys.path``."""
    if os.getcwd() not in sys.path:       # console scripts do not put the cwd on sys.path
        sys.path.append(os.getcwd())
    try:
        return importlib.util.find_spec(name)
    except Exception:   # noqa: BLE001 -- a parent package that fails: load_policy_class says how
        return None


def _execute(policy: str, spec, source: bytes) -> None:
    """Run ``source`` (the bytes just hashed, not a bytecode cache) as module ``spec.name`` in
    ``sys.modules`` (and on its package). When it raises, no module of that name is left
    (the one held before ran other code) and the ConfigError is ``load_policy_class``'."""
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        exec(compile(source, spec.origin, "exec"), module.__dict__)   # noqa: S102 -- user's
    except BaseException as error:
        del sys.modules[spec.name]
        _RUNNING.pop(spec.name, None)
        if not isinstance(error, (Exception, SystemExit)):   # an interrupt goes on as it is
            raise
        load_policy_class(policy)                # names the failure as simulate does
        raise ConfigError(f"custom policy {policy!r}: running {spec.origin} raised "
                          f"{type(error).__name__}: {error}") from None
    package, _, child = spec.name.rpartition(".")
    if package:
        setattr(sys.modules[package], child, module)
