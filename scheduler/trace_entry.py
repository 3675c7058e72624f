"""One request of a workload (``TraceEntry``) and the project's JSONL trace format: a line
parsed and checked against the limits (tokens, hash ids, arrival times), and a file written.

A trace file is JSONL, one object per line: ``{"prompt_len": 584, "output_len": 374,
"arrival_s": 0.0}`` (plus ``"hash_ids"`` when the entry has them, ``"adapter"`` and
``"adapter_bytes"`` when it names a LoRA adapter; any other key is refused, naming it: a
misspelt ``"arrival"`` was ignored and the request replayed at 0 s), gzip-compressed when its
name ends in ``.gz``. ``scheduler/traces.py`` reads a path by its name the same way (``.csv``:
Azure's columns, so ``write_trace`` refuses a ``.csv`` name rather than write what would be
misread).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Tuple

from .cliargs import file_problem
from .errors import ConfigError
from .field_checks import file_name
from .result_files import atomic_open

if TYPE_CHECKING:
    from .adapters import AdapterRef

# The latest arrival a workload may have, seconds. The simulated clock is a float: at 1e10 s
# (317 years) it steps by 2 microseconds, past it a step's milliseconds round away and every
# latency with them (epoch times given as seconds are ~1.7e9; in ms, 1.7e12, are refused).
MAX_ARRIVAL_S = 1e10
MAX_TRACE_TOKENS = 10**9     # a request longer than this is a corrupt line, not a request
MOONCAKE_BLOCK_TOKENS = 512   # tokens per hash id block (Mooncake traces, our JSONL's hash_ids)
# The keys a line of the project's JSONL may hold: the first three in every line, then optional.
TRACE_LINE_KEYS = ("prompt_len", "output_len", "arrival_s", "hash_ids", "adapter", "adapter_bytes")


@dataclass(frozen=True)
class TraceEntry:
    """One request of a workload, in tokens and seconds."""
    prompt_len: int     # tokens in the prompt, >= 1
    output_len: int     # tokens to generate, >= 1
    arrival_s: float    # seconds after the start of the run, >= 0
    hash_ids: Tuple[int, ...] = ()   # Mooncake traces: ids of the prompt's 512-token blocks
    adapter: Optional["AdapterRef"] = None   # the LoRA adapter the request runs with, if any

    def __post_init__(self) -> None:
        """The token counts are checked here (``True`` ran as 1 token, NaN was blamed on the
        simulation's memory), and the hash ids, none or one per 512-token prompt block (kept
        as a tuple; a wrong count made ``prompt_token_ids`` a prompt of another length, a list
        was unhashable in the simulator's memo); arrivals by ``check_arrivals``, which names
        the entry's index."""
        for name in ("prompt_len", "output_len"):
            check_token_count(f"TraceEntry.{name}", getattr(self, name))
        ids = self.hash_ids
        if not isinstance(ids, (list, tuple)) or (ids and not _hash_ids_fit(ids, self.prompt_len)):
            raise ConfigError(_hash_ids_refusal("TraceEntry.hash_ids", "prompt_len",
                                                self.prompt_len, ids))
        object.__setattr__(self, "hash_ids", tuple(ids))

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def write_trace(path: str, entries: Iterable[TraceEntry]) -> None:
    """Write ``entries`` as JSONL (one object per line), gzip-compressed when ``path`` (a str
    or os.PathLike) ends in ``.gz``, whole or not at all; ``load_trace(path)`` reads back the
    same entries. A name the reader would read as another format (``check_trace_name``) is
    refused first, as is a path where no file can be written whole (``file_problem``: a folder,
    ``""``, a device or a pipe, which the file written replaced, /dev/null too)."""
    path = trace_file_name(path, "write_trace")
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"write_trace {problem}")
    check_trace_name(path)
    lines = []
    for e in entries:
        obj = {"prompt_len": e.prompt_len, "output_len": e.output_len, "arrival_s": e.arrival_s}
        if e.hash_ids:
            obj["hash_ids"] = list(e.hash_ids)
        if e.adapter is not None:
            obj["adapter"], obj["adapter_bytes"] = e.adapter.name, e.adapter.num_bytes
        lines.append(json.dumps(obj) + "\n")
    data = "".join(lines).encode("utf-8")
    with atomic_open(path, "wb") as f:
        f.write(gzip.compress(data, mtime=0) if path.endswith(".gz") else data)


def trace_file_name(path, name: str) -> str:
    """``path``, a bundled trace's name or a file name (a str, or an os.PathLike naming one),
    as a str; ConfigError naming ``name`` otherwise (an int was opened as the caller's file
    descriptor, read and closed; a pathlib.Path raised AttributeError)."""
    checked = file_name(path)
    if checked is None:
        raise ConfigError(f"{name}: a trace is a bundled trace's name or a file name (str or "
                          f"os.PathLike), got {type(path).__name__} {_short(path)}")
    return checked


def check_trace_name(path: str, name: str = "write_trace") -> None:
    """ConfigError naming ``name`` when ``path``'s suffix makes the trace reader read it as
    another format than the JSONL ``write_trace`` writes: ``.csv`` (or ``.csv.gz``) is read as
    Azure's columns; a bundled trace's name (``azure-code``) is read as the bundled trace. The
    reader's rules, exactly: the bundled names, then ``.gz`` (no other case is decompressed),
    then ``.csv``."""
    from .traces import BUNDLED        # traces.py reads what this module writes
    if path in BUNDLED:
        raise ConfigError(f"{name} {path}: --trace {path} replays the bundled trace of that "
                          f"name, not this file; give another name ({path}.jsonl)")
    base = path[:-3] if path.endswith(".gz") else path
    if base.endswith(".csv"):
        raise ConfigError(f"{name} {path}: a .csv trace is read as Azure's columns "
                          f"(TIMESTAMP,ContextTokens,GeneratedTokens), and the trace written "
                          f"is JSONL; name it .jsonl (or .jsonl.gz)")


def check_arrivals(entries: Sequence[TraceEntry], what: str = "the workload") -> None:
    """ConfigError naming ``what`` and an entry (its index in ``entries``): the first whose
    arrival is not a finite number of seconds >= 0 (each is looked at: max() skipped a NaN that
    was not first, and the run loop waited for it for ever), or the latest, past
    ``MAX_ARRIVAL_S``."""
    for i, e in enumerate(entries):
        t = e.arrival_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise ConfigError(f"{what}: entry {i} arrives at {t!r} s; an arrival must be a "
                              f"finite number of seconds >= 0")
    i, t = max(enumerate(e.arrival_s for e in entries), key=lambda it: it[1], default=(0, 0.0))
    if t > MAX_ARRIVAL_S:                                   # the latest names the scale
        raise ConfigError(f"{what}: an arrival at {t:.4g} s is past {MAX_ARRIVAL_S:.0e} s "
                          f"(entry {i}; 317 years), where the simulated float clock loses "
                          f"a step's milliseconds")


def object_once(pairs: list) -> dict:
    """A JSON object's ``pairs`` as a dict (``json.loads``'s ``object_pairs_hook``), ConfigError
    naming a key the object gives twice: ``json`` kept the later value silently (a trace line's
    ``"prompt_len": 10, "prompt_len": 20`` ran 20 tokens, a JSON sweep spec's second
    ``policy`` list replaced the first)."""
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            raise ConfigError(f"key {_short(key)} is given twice in one object (JSON kept the "
                              f"later value silently); give it once")
        obj[key] = value
    return obj


def parse_trace_object(obj, where: str) -> TraceEntry:
    """One decoded line of the project's JSONL format; ``ConfigError`` naming ``where`` if bad,
    or if it holds a key not in ``TRACE_LINE_KEYS`` (naming the key). A line naming an
    ``adapter`` (and its ``adapter_bytes``) gives a synthetic ``AdapterRef``
    (``synthetic_adapter``: its digest is the SHA-256 of the name)."""
    refuse_unknown_keys(obj, where, TRACE_LINE_KEYS, "a trace line")
    adapter = _parse_adapter(obj, where)
    entry = parse_entry(obj, where, TRACE_LINE_KEYS[:3])
    return entry if adapter is None else replace(entry, adapter=adapter)


def refuse_unknown_keys(obj, where: str, keys: Tuple[str, ...], whose: str,
                        required: int = 3) -> None:
    """ConfigError naming ``where`` and the first key of the decoded line ``obj`` not in
    ``keys`` (the first ``required`` required, the rest optional; ``whose``: the line's
    format, for the message): a key a format does not read was dropped silently."""
    unknown = [key for key in obj if key not in keys] if isinstance(obj, dict) else ()
    if unknown:
        optional = f" and may hold {', '.join(keys[required:])}" if keys[required:] else ""
        raise ConfigError(f"{where}: unknown key {_short(unknown[0])}; {whose} holds "
                          f"{', '.join(keys[:required])}{optional}")


def _parse_adapter(obj, where: str) -> Optional["AdapterRef"]:
    """The adapter a project line names, or None where it names none."""
    if not isinstance(obj, dict) or ("adapter" not in obj and "adapter_bytes" not in obj):
        return None
    name, size = obj.get("adapter"), obj.get("adapter_bytes")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: adapter must be a non-empty string, got {name!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{where}: adapter_bytes must be an int >= 1 with adapter {name!r}, "
                          f"got {size!r}")
    return synthetic_adapter(name, size)


def parse_entry(obj, where: str, keys: Tuple[str, str, str], units_per_second: float = 1.0,
                time_unit: str = "", required: bool = False) -> TraceEntry:
    """A ``TraceEntry`` from a decoded JSON object whose prompt, output and arrival fields are
    named ``keys``, all three required (arrival times in ``1 / units_per_second`` s, at most
    ``MAX_ARRIVAL_S``) with ``hash_ids`` (``required``, or optional), exactly one per
    ``MOONCAKE_BLOCK_TOKENS``-token prompt block. ``ConfigError`` naming ``where``, the field
    and the value otherwise."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected an object, got {type(obj).__name__}")
    values = []
    for key in keys[:2]:
        v = obj.get(key)
        check_token_count(f"{where}: {key}", v)
        values.append(v)
    hash_ids = _parse_hash_ids(obj, where, keys[0], values[0], required)
    arrival_s = _parse_arrival_s(obj, where, keys[2], units_per_second, time_unit)
    return TraceEntry(values[0], values[1], arrival_s, hash_ids)


def _parse_hash_ids(obj: dict, where: str, prompt_key: str, prompt_len: int,
                    required: bool) -> Tuple[int, ...]:
    """A line's ``hash_ids`` (none where it has none and they are not ``required``), one per
    ``MOONCAKE_BLOCK_TOKENS``-token block of its ``prompt_len``-token prompt."""
    hash_ids = obj.get("hash_ids", [])
    if not isinstance(hash_ids, list) or ((hash_ids or required)
                                          and not _hash_ids_fit(hash_ids, prompt_len)):
        raise ConfigError(_hash_ids_refusal(f"{where}: hash_ids", prompt_key, prompt_len,
                                            hash_ids))
    return tuple(hash_ids)


def _hash_ids_fit(hash_ids: Sequence, prompt_len: int) -> bool:
    """``hash_ids`` are one int >= 0 per ``MOONCAKE_BLOCK_TOKENS``-token block of the prompt."""
    return (len(hash_ids) == -(-prompt_len // MOONCAKE_BLOCK_TOKENS) and
            all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids))


def _hash_ids_refusal(field: str, prompt_key: str, prompt_len: int, hash_ids) -> str:
    return (f"{field} must list {-(-prompt_len // MOONCAKE_BLOCK_TOKENS)} ints >= 0 (one per "
            f"{MOONCAKE_BLOCK_TOKENS}-token block of {prompt_key} {prompt_len}), got "
            f"{_short(hash_ids)}")


def _parse_arrival_s(obj: dict, where: str, key: str, units_per_second: float,
                     time_unit: str) -> float:
    """A line's arrival, ``obj[key]`` in ``1 / units_per_second`` s, as seconds: required (a
    missing one was read as 0 s, silently), finite, >= 0 and at most ``MAX_ARRIVAL_S``."""
    unit = f" of {time_unit}" if time_unit else ""
    if key not in obj:
        raise ConfigError(f"{where}: no {key}; every line needs its arrival, a number"
                          f"{unit or ' of seconds'} >= 0 after the trace's start")
    arrival = obj[key]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival < math.inf:
        raise ConfigError(f"{where}: {key} must be a finite number{unit} >= 0, got {arrival!r}")
    if arrival > MAX_ARRIVAL_S * units_per_second:   # not arrival / units: an int past a
        shown = shown_int(arrival) if isinstance(arrival, int) else f"{arrival:g}"   # float's range
        raise ConfigError(f"{where}: {key} {shown}{unit} is past {MAX_ARRIVAL_S:.0e} s "
                          f"(317 years), where the simulated float clock loses a step's "
                          f"milliseconds: give {time_unit or 'seconds'} since the trace's start, "
                          f"not since the epoch")
    return arrival / units_per_second


def check_token_count(field: str, value) -> None:
    """``value`` is a request's count of tokens: an int (not a bool) in [1,
    ``MAX_TRACE_TOKENS``]; ConfigError naming ``field``, the value and the range otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TRACE_TOKENS:
        shown = shown_int(value) if isinstance(value, int) else _short(value)
        raise ConfigError(f"{field} must be an int in [1, {MAX_TRACE_TOKENS:,}], got {shown}")


def shown_int(value: int) -> str:
    """An int for a message: as written up to 12 digits, else ``1e+20`` (or its digit count,
    where a float cannot hold it)."""
    if abs(value) < 10**12:
        return str(value)
    digits = len(str(abs(value)))
    return f"{float(value):.3g}" if digits < 300 else f"a {digits:,}-digit number"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def synthetic_adapter(name: str, num_bytes: int) -> "AdapterRef":
    """An adapter the simulator makes up: its digest is the SHA-256 of its name."""
    from .adapters import AdapterRef
    return AdapterRef(name, hashlib.sha256(name.encode()).hexdigest(), num_bytes)
