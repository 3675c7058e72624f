"""Build and load ``cpu_varlen.c`` (the ``cpu-varlen`` backend's kernel) through ctypes.

A C source is compiled once per (source and its headers, compiler flags, CPU) into a per-user
cache folder (``runtime/cache_dir.py``: ``$VMEMKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/vmemkv``,
else ``~/.cache/vmemkv``; one that cannot be written is a :class:`KernelBuildError` naming
``$VMEMKV_CACHE_DIR``) with the system C compiler: a few seconds, no torch headers.
``-march=native`` is safe because the CPU's model and flags are part of the key. The attention
kernel is built once per (head size, K/V dtype) it is called with (``-DVK_ONLY_DT``/
``-DVK_ONLY_D``: one copy of the key walk, 3-6 s to build, where the copy of every shape took
130-156 s on a 2-core VM). Each new build deletes the builds of its source not loaded for 30
days (older versions' keys), so upgrades do not pile them up.
``kernel(head_dim, dtype_code)`` returns that shape's loaded attention function, or raises
:class:`KernelBuildError` saying why (no compiler, a failed build); ``why_unavailable()`` gives
that reason without raising. ``library(source)`` builds and loads any other source the same
way (the yardsticks' native loops, ``benchmarks/yardstick.c``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from ..cache_dir import cache_root, unusable_cache
from .errors import AttentionError

SOURCE = Path(__file__).with_name("cpu_varlen.c")
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_varlen_math.h", "cpu_varlen_tile.h"))
# ^ included by SOURCE: part of the key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 600   # one shape builds in 3-6 s; the yardsticks' and every-shape builds take longer
SPECIALISED_HEAD_DIMS = (32, 64, 128, 256)   # cpu_varlen_tile.h's walk_keys: D a constant
STALE_BUILD_AGE_S = 30 * 24 * 3600   # a build not loaded for 30 days is pruned at the next build


class KernelBuildError(AttentionError):
    """The native kernel could not be compiled or loaded here (the message says why)."""


def _cpu_key() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "|" + "|".join(lines)


def compiler_command() -> tuple | None:
    """The C compiler's command line: ``$CC`` split as a shell splits it (``ccache gcc``,
    ``gcc -m64``, as make takes it: run whole, it was one missing file and cpu-varlen
    unavailable), else cc or gcc on the PATH; None without any. ValueError for a ``$CC`` a
    shell cannot split (unbalanced quotes)."""
    command = tuple(shlex.split(os.environ.get("CC", "")))
    found = command or shutil.which("cc") or shutil.which("gcc")
    return (found,) if isinstance(found, str) else found


def _build(cc, source_path: Path, headers: tuple, defines: tuple = ()) -> Path:
    """``source_path`` built with ``cc`` (one program, or a command line as a tuple)."""
    cc = (cc,) if isinstance(cc, str) else tuple(cc)
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in headers)
    flags = FLAGS + defines
    key = hashlib.sha256(source + " ".join(cc + flags).encode() + _cpu_key().encode())
    target = cache_root() / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        _touch(target)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        build_dir = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError as error:   # a file in its place, a read-only home: the user's to move
        raise KernelBuildError(unusable_cache("the kernel cache", target.parent, error)) from error
    with build_dir as tmp:   # build, then rename: atomic
        out = Path(tmp) / target.name
        run = subprocess.run([*cc, *flags, str(source_path), "-o", str(out), "-lm"],
                             capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if run.returncode:
            raise KernelBuildError(f"{shlex.join(cc)} failed to build {source_path.name} (exit "
                                   f"{run.returncode}): {run.stderr.strip()[-400:]}")
        os.replace(out, target)
    prune_builds(target.parent, source_path.stem, keep=target)
    return target


def _touch(path: Path) -> None:
    """Mark a build used now (its mtime), so ``prune_builds`` keeps it."""
    try:
        os.utime(path)
    except OSError:   # read-only cache, or pruned by another process: loading decides
        pass


def prune_builds(folder: Path, stem: str, keep: Path, max_age_s: float = STALE_BUILD_AGE_S) -> list:
    """Delete ``stem``'s builds in ``folder`` not used (loaded or built) for ``max_age_s``:
    those of older sources, flags or CPUs, which no key names any more. Each process touches
    the build it loads, so one in use is never that old; a process that loaded a build keeps
    its mapping when the file goes. Returns the paths removed."""
    removed, now = [], time.time()
    for path in folder.glob(f"{stem}-*.so"):
        try:
            if path != keep and now - path.stat().st_mtime > max_age_s:
                path.unlink()
                removed.append(path)
        except OSError:   # gone already (another process pruned it), or not ours to delete
            continue
    return removed


@lru_cache(maxsize=None)
def _library(source: Path, headers: tuple = (), defines: tuple = ()):
    """(CDLL, "") or (None, why not): built and loaded once per process."""
    try:
        cc = compiler_command()
    except ValueError as error:   # unbalanced quotes: availability raised it
        return None, f"$CC {os.environ.get('CC')!r} is not a command line ({error})"
    if cc is None:
        return None, f"no C compiler (cc/gcc, or $CC) to build {source.name}"
    try:
        return ctypes.CDLL(str(_build(cc, source, headers, defines))), ""
    except (OSError, subprocess.SubprocessError, KernelBuildError) as error:
        return None, f"{source.name} unavailable: {error}"


def library(source: Path, headers: tuple = ()) -> ctypes.CDLL:
    """``source`` (and the ``headers`` it includes) built with the kernel's flags and loaded;
    :class:`KernelBuildError` if it cannot be."""
    lib, why = _library(Path(source), tuple(Path(h) for h in headers))
    if lib is None:
        raise KernelBuildError(why)
    return lib


@lru_cache(maxsize=None)
def _load(head_dim: int, dtype_code: int, vector_lanes: int | None = None, vbmi: bool = True):
    """(function, "") or (None, why not) for one shape (``head_dim`` 0: any head size outside
    SPECIALISED_HEAD_DIMS): built and loaded once per process."""
    defines = (f"-DVK_ONLY_DT={dtype_code}", f"-DVK_ONLY_D={head_dim}")
    if vector_lanes is not None:
        defines += (f"-DVW={vector_lanes}",)
    if not vbmi:
        defines += ("-DVK_NO_VBMI",)
    lib, why = _library(SOURCE, HEADERS, defines)
    if lib is None:
        return None, f"cpu-varlen kernel unavailable: {why}"
    fn = lib.vk_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, ctypes.c_int, p, p, p, p, p, p, i64, i64, p, p, p,
                   p, p, i64,
                   i64, i64, i64, ctypes.c_float, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn, ""


def _shape(head_dim: int) -> int:
    return head_dim if head_dim in SPECIALISED_HEAD_DIMS else 0


def why_unavailable(head_dim: int = 64, dtype_code: int = 0) -> str:
    """Empty when the kernel for that shape (by default fp32, head size 64) is built and
    loaded, else the reason it cannot be."""
    return _load(_shape(head_dim), dtype_code)[1]


def kernel(head_dim: int, dtype_code: int, vector_lanes: int | None = None, vbmi: bool = True):
    """The loaded ``vk_attention`` function for K/V of ``head_dim`` and ``dtype_code``
    (cpu_varlen_math.h's DT_*); :class:`KernelBuildError` if it cannot be built. It returns
    -2 when called with another shape. ``vector_lanes`` (8 or 16) forces the fp32 vector
    width instead of the CPU's (16 with AVX-512, else 8), and ``vbmi=False`` the build of an
    AVX-512 CPU without VBMI where the CPU has it (fp8 through F16C, not by table):
    how the tests run every build's arithmetic on one machine."""
    if vector_lanes not in (None, 8, 16):
        raise KernelBuildError(f"vector_lanes must be 8, 16 or None, got {vector_lanes!r}")
    fn, why = _load(_shape(head_dim), dtype_code, vector_lanes, vbmi)
    if fn is None:
        raise KernelBuildError(why)
    return fn
