"""Real request traces, bundled with the package and replayed by name, and any trace file by path.

Bundled (``scheduler/data/traces/``, gzip; licences and attribution in its README.md):

    azure-conv              Azure LLM inference 2023, conversation service  CC-BY 4.0    19,366 rows
    azure-code              Azure LLM inference 2023, code service          CC-BY 4.0     8,819 rows
    mooncake-conversation   Mooncake (Kimi), conversation trace             Apache-2.0   12,031 rows
    mooncake-synthetic      Mooncake, synthetic trace                       Apache-2.0    3,993 rows

Every loader returns ``TraceEntry`` objects sorted by arrival (stable), arrivals in seconds
(Azure's wall-clock stamps become seconds after its first request). Mooncake entries keep their ``hash_ids``: ids of 512-token prompt
blocks, equal ids meaning equal blocks (``prompt_token_ids`` makes tokens up from them, so equal
ids give equal tokens and prefix caching sees the trace's real sharing). A path is read by its
format: ``.csv`` (Azure columns), JSONL with Mooncake keys, or the project's own JSONL
(``prompt_len``, ``output_len``, ``arrival_s``, optional ``hash_ids``); ``.gz`` is decompressed.
A JSONL file's format is its first line's, and a later line of the other format is refused (a
mix read one line's ms beside another's seconds). Files are inflated and parsed line by line as
they are read, what they may hold checked against available memory as it grows
(``trace_stream``), and reading stops at the line after the first ``max_requests``: those lines
must then be in arrival order (the line after them too: arriving earlier, it would be among
the first N by arrival), and the file is trusted to be in order past them.
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from importlib import resources
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .errors import ConfigError
from .trace_entry import object_once, refuse_unknown_keys, trace_file_name
from .trace_stream import numbered_lines, text_lines
from .workload import (MAX_ARRIVAL_S, MAX_TRACE_TOKENS, MOONCAKE_BLOCK_TOKENS,  # noqa: F401
                       TraceEntry, check_arrivals, parse_entry, parse_trace_object,
                       scale_to_length, shown_int)


@dataclass(frozen=True)
class BundledTrace:
    """One trace shipped with the package."""
    name: str
    file: str          # under scheduler/data/traces/
    source: str
    license: str
    rows: int          # requests in the file


BUNDLED: Dict[str, BundledTrace] = {t.name: t for t in (
    BundledTrace("azure-conv", "azure_llm_2023_conv.csv.gz",
                 "Azure LLM inference trace 2023, conversation (Patel et al., Splitwise, ISCA 2024)",
                 "CC-BY 4.0", 19366),
    BundledTrace("azure-code", "azure_llm_2023_code.csv.gz",
                 "Azure LLM inference trace 2023, code (Patel et al., Splitwise, ISCA 2024)",
                 "CC-BY 4.0", 8819),
    BundledTrace("mooncake-conversation", "mooncake_conversation.jsonl.gz",
                 "Mooncake conversation trace (Qin et al., FAST 2025)", "Apache-2.0", 12031),
    BundledTrace("mooncake-synthetic", "mooncake_synthetic.jsonl.gz",
                 "Mooncake synthetic trace (Qin et al., FAST 2025)", "Apache-2.0", 3993),
)}


def trace_names() -> Tuple[str, ...]:
    """Names of the bundled traces, for ``--trace NAME``."""
    return tuple(BUNDLED)


def load_trace(name_or_path: str, *, rate_scale: float = 1.0,
               max_requests: Optional[int] = None,
               rate_name: str = "rate_scale") -> List[TraceEntry]:
    """The trace named (bundled) or at a path (a str or os.PathLike), sorted by arrival.

    ``rate_scale`` X divides every arrival time by X (X = 2 replays twice as fast); ``max_requests``
    keeps the first N requests of the file, reading one line further and no more (a huge trace
    need not fit in memory), so they are the first N by arrival only in a file in arrival order
    (the bundled traces and ``write_trace``'s are): a line among them, or the one after them,
    arriving before the line above it is refused, naming both (it kept the first N lines
    silently; lines past the one after them are not read, so their order is trusted). Bad values
    raise ``ConfigError`` naming the value and the limit (``rate_name``: how the caller calls the
    rate, ``--rate-scale`` on the command line; a rate so low that an arrival passes
    ``MAX_ARRIVAL_S`` is refused); a bad file raises ``ConfigError`` naming the file and line,
    and one whose text read so far does not fit in available memory ``SimulationTooLargeError``
    (``trace_stream``), before it is parsed."""
    check_rate_scale(rate_scale)
    if max_requests is not None and (isinstance(max_requests, bool)
                                     or not isinstance(max_requests, int) or max_requests < 1):
        raise ConfigError(f"max_requests must be an int >= 1, got {max_requests!r}")
    name_or_path = trace_file_name(name_or_path, "load_trace")
    if name_or_path in BUNDLED:
        entries = _read_bundled(BUNDLED[name_or_path], max_requests)
    else:
        entries = _read_path(name_or_path, max_requests)
    return scale_arrivals(entries, rate_scale, name_or_path, rate_name)


def check_rate_scale(rate_scale: float) -> None:
    if isinstance(rate_scale, bool) or not (isinstance(rate_scale, (int, float)) and
                                            0 < rate_scale < math.inf):
        raise ConfigError(f"rate_scale must be a finite number > 0, got {rate_scale!r}")


def scale_arrivals(entries: List[TraceEntry], rate_scale: float, name_or_path: str,
                   rate_name: str = "rate_scale") -> List[TraceEntry]:
    """``entries`` of ``name_or_path`` replayed ``rate_scale`` times as fast, as load_trace."""
    check_rate_scale(rate_scale)
    if rate_scale != 1.0:
        entries = [replace(e, arrival_s=e.arrival_s / rate_scale) for e in entries]
        check_arrivals(entries, f"trace {name_or_path} at {rate_name} {rate_scale:g}")
    return entries


def _read_bundled(trace: BundledTrace, max_requests: Optional[int]) -> List[TraceEntry]:
    with resources.files(__package__).joinpath("data", "traces", trace.file).open("rb") as raw:
        name = trace.file.removesuffix(".gz")
        return _parse(text_lines(raw, trace.name, True, name.endswith(".csv")), name,
                      trace.name, max_requests)


def _read_path(path: str, max_requests: Optional[int]) -> List[TraceEntry]:
    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise ConfigError(f"trace {path!r} is neither a bundled trace ({', '.join(BUNDLED)}) "
                          f"nor an existing file") from None
    except OSError as error:
        raise ConfigError(f"cannot read trace {path!r}: {error.strerror}") from None
    gz = path.endswith(".gz")
    name = path[:-3] if gz else path
    with raw:
        return _parse(text_lines(raw, path, gz, name.endswith(".csv")), name, path,
                      max_requests)


Row = Tuple[str, TraceEntry]       # a request read: where it is ("FILE line N"), the entry


def _parse(lines: Iterator[str], file_name: str, where: str,
           max_requests: Optional[int]) -> List[TraceEntry]:
    """The first ``max_requests`` entries of the file's ``lines`` (all with None), sorted by
    arrival (stable). With a number N, N + 1 lines are read (no line past them), each arriving
    no earlier than the one above it (``_in_arrival_order``); the N kept are then the first N by
    arrival of a file in arrival order. Azure stamps are wall-clock times: they become seconds
    after the first of them; JSONL arrivals are kept as written."""
    azure = file_name.endswith(".csv")
    rows = _azure_rows(lines, where) if azure else _jsonl_rows(lines, where)
    if max_requests is not None:
        rows = _in_arrival_order(rows, max_requests)
    entries = [entry for _, entry in itertools.islice(rows, max_requests)]
    if max_requests is not None and len(entries) == max_requests:
        next(rows, None)    # the line after the N-th: one arriving before it is refused
    if not entries:
        raise ConfigError(f"trace {where} has no requests")
    if azure:
        first = min(e.arrival_s for e in entries)
        entries = [replace(e, arrival_s=e.arrival_s - first) for e in entries]
        check_arrivals(entries, f"trace {where} (TIMESTAMP after its first)")
    entries.sort(key=lambda e: e.arrival_s)
    return entries


def _in_arrival_order(rows: Iterator[Row], max_requests: int) -> Iterator[Row]:
    """``rows``, each checked to arrive no earlier than the one before it: ``max_requests`` N
    keeps the first N lines, the first N by arrival only in a file in arrival order. The line
    after the N-th is checked too (``_parse`` reads it): arriving before the N-th, it is among
    the first N by arrival and was left out silently. Lines past it are not read, so order is
    trusted there (finding the first N of an unsorted file takes reading it all, and reading
    it all would be charged all of it, ``trace_stream``, where keeping fewer requests is the
    remedy for a trace too big)."""
    previous: Optional[Row] = None
    for index, (at, entry) in enumerate(rows, 1):
        if previous is not None and entry.arrival_s < previous[1].arrival_s:
            raise ConfigError(_out_of_order(at, previous, entry, max_requests, index))
        previous = at, entry
        yield at, entry


def _out_of_order(at: str, previous: Row, entry: TraceEntry, max_requests: int,
                  index: int) -> str:
    """Why the ``index``-th request read (``at``, ``entry``) is refused: it arrives before the
    one above it (``previous``)."""
    early_s = previous[1].arrival_s - entry.arrival_s
    why = f"{at}: arrives {early_s:g} s before the line above it ({previous[0]})"
    if index > max_requests:         # the line after the N kept
        why += (f", the last of the {max_requests:,} that max_requests (--max-requests) "
                f"{max_requests} keeps: it is among the first {max_requests:,} by arrival and "
                f"would be left out, and finding them in a trace not in arrival order takes "
                f"reading all of it")
    return (f"{why}; max_requests (--max-requests) keeps the first N lines, the first N by "
            f"arrival only in a trace in arrival order: sort the file by arrival, or read it "
            f"all (no max_requests)")


def _azure_rows(lines: Iterator[str], where: str) -> Iterator[Row]:
    rows = _csv_lines(lines, where)
    header = [h.strip() for h in next(rows, (1, []))[1]]
    if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        raise ConfigError(f"{where}: expected the Azure columns TIMESTAMP,ContextTokens,"
                          f"GeneratedTokens, got {','.join(header)!r}")
    for lineno, row in rows:
        if not row:
            continue
        at = f"{where} line {lineno}"
        if len(row) != 3:
            raise ConfigError(f"{at}: expected 3 columns, got {len(row)}")
        prompt, output = (_positive_int(v, name, at) for v, name in
                          ((row[1], "ContextTokens"), (row[2], "GeneratedTokens")))
        yield at, TraceEntry(prompt, output, _azure_seconds(row[0], at))


def _csv_lines(lines: Iterator[str], where: str) -> Iterator[Tuple[int, List[str]]]:
    """(the file line a row is on, the row), counted from the csv reader's ``line_num`` (file
    lines, not rows). An Azure row is one line: a quoted field holding a line break (``"396``
    then ``"`` on the next line read as 396, and every later line was named one too early) or
    text that is not CSV is a ConfigError naming its line."""
    reader, end = csv.reader(lines), 0
    while True:
        try:
            row = next(reader, None)
        except csv.Error as error:      # a field past csv's limit, a bare carriage return
            raise ConfigError(f"{where} line {reader.line_num}: not CSV ({error})") from None
        if row is None:
            return
        start, end = end + 1, reader.line_num
        if start != end or any("\n" in field or "\r" in field for field in row):
            how = f"the row runs on to line {end}" if end > start else "its quote never closes"
            raise ConfigError(f"{where} line {start}: a quoted field holds a line break "
                              f"({how}); an Azure row is one line")
        yield start, row


def _azure_seconds(stamp: str, where: str) -> float:
    """Seconds since the epoch of an Azure stamp (``2023-11-16 18:15:46.6805900``, 7 digits)."""
    day, _, frac = stamp.strip().partition(".")
    try:
        if frac and not (frac.isascii() and frac.isdigit()):   # "46.5e3" would read as 500 s
            raise ValueError(frac)
        whole = datetime.strptime(day, "%Y-%m-%d %H:%M:%S")
        fraction = float("0." + frac) if frac else 0.0
    except ValueError:
        raise ConfigError(f"{where}: TIMESTAMP {stamp!r} is not 'YYYY-MM-DD HH:MM:SS.fffffff'") from None
    return (whole - datetime(1970, 1, 1)).total_seconds() + fraction


def _positive_int(text: str, name: str, where: str) -> int:
    """A token count of an Azure row: an int in [1, MAX_TRACE_TOKENS], as JSONL lengths are."""
    want = f"{where}: {name} must be an int in [1, {MAX_TRACE_TOKENS:,}], got"
    try:
        if not (text.isascii() and text.strip().lstrip("+-").isdigit()):
            raise ValueError(text)      # int() read "1_0", and Arabic-Indic digits, as 10
        value = int(text)
    except ValueError:       # not an int, or more digits than Python converts
        shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text):,} characters)"
        raise ConfigError(f"{want} {shown!r}") from None
    if not 1 <= value <= MAX_TRACE_TOKENS:
        raise ConfigError(f"{want} {shown_int(value)}")
    return value


def _mooncake_entry(obj: dict, where: str) -> TraceEntry:
    """Its four keys, all required, and no other (an ``adapter`` was dropped silently)."""
    refuse_unknown_keys(obj, where, ("input_length", "output_length", "timestamp", "hash_ids"),
                        "a Mooncake trace line", required=4)
    return parse_entry(obj, where, ("input_length", "output_length", "timestamp"),
                       units_per_second=1000.0, time_unit="ms", required=True)


@dataclass(frozen=True)
class JsonlFormat:
    """One of the JSONL formats a trace file is written in; a file holds one."""
    name: str                                   # for messages: whose, keys and time unit
    marker: str                                 # a key that only this format's lines hold
    parse: Callable[[object, str], TraceEntry]  # (decoded line, "FILE line N") -> entry


MOONCAKE_JSONL = JsonlFormat("Mooncake (input_length, output_length, timestamp in ms)",
                             "input_length", _mooncake_entry)
PROJECT_JSONL = JsonlFormat("project (prompt_len, output_len, arrival_s in s)",
                            "prompt_len", parse_trace_object)


def _jsonl_rows(lines: Iterator[str], where: str) -> Iterator[Row]:
    """Entries of JSONL text, each line read in the format of the file's first line (the
    project's where that line has neither format's marker); a later line holding the other
    format's marker is refused, naming it and the first line; so is a line naming an adapter
    an earlier line named with another size (``_one_size``)."""
    file_format: Optional[JsonlFormat] = None
    first_at, sizes = "", {}
    for lineno, line in numbered_lines(lines):
        at = f"{where} line {lineno}"
        obj = _json_line(line, at)
        line_format = _format_of(obj)
        if file_format is None:
            file_format, first_at = line_format or PROJECT_JSONL, at
        elif line_format not in (None, file_format):
            raise ConfigError(f"{at}: a line of the {line_format.name} format in a trace "
                              f"whose first line ({first_at}) is of the {file_format.name} "
                              f"format; a file holds one format")
        entry = file_format.parse(obj, at)
        if entry.adapter is not None:
            _one_size(entry.adapter, at, sizes)
        yield at, entry


def _one_size(adapter, at: str, sizes: Dict[str, Tuple[int, str]]) -> None:
    """ConfigError naming both lines when ``adapter``'s name came earlier (``sizes``: name ->
    bytes and line) with other ``adapter_bytes``: a name is one adapter (its digest is the
    name's), and the run failed part way with an AdapterStateError naming neither line."""
    size, first_at = sizes.setdefault(adapter.name, (adapter.num_bytes, at))
    if size != adapter.num_bytes:
        raise ConfigError(f"{at}: adapter {adapter.name!r} with adapter_bytes "
                          f"{adapter.num_bytes}, and {first_at} names it with {size}: an "
                          f"adapter has one size")


def _format_of(obj) -> Optional[JsonlFormat]:
    """The format whose marker a decoded line holds (Mooncake's first), or None."""
    if isinstance(obj, dict):
        for trace_format in (MOONCAKE_JSONL, PROJECT_JSONL):
            if trace_format.marker in obj:
                return trace_format
    return None


def _json_line(line: str, at: str):
    """The decoded JSON of one trace line; ConfigError naming ``at`` if it is not JSON."""
    try:
        return json.loads(line, object_pairs_hook=object_once)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{at}: not JSON ({error.msg})") from None
    except ConfigError as error:       # a key given twice
        raise ConfigError(f"{at}: {error}") from None
    except ValueError as error:        # an int of more digits than Python converts
        raise ConfigError(f"{at}: not a trace line ({error})") from None
    except RecursionError:
        raise ConfigError(f"{at}: JSON nested too deeply to be a trace line") from None


def prompt_token_ids(entry: TraceEntry, vocab_size: int, *, seed: int = 0) -> Tuple[int, ...]:
    """Made-up prompt tokens for ``entry``, ``prompt_len`` of them: block i of
    ``MOONCAKE_BLOCK_TOKENS`` tokens is a function of ``(seed, hash_ids[i])`` only, so equal
    hash ids give equal tokens (a request's last, partial block is the leading part of its id's
    block; ``TraceEntry`` holds one id per block). Token ids are in ``[1, vocab_size)``. An
    entry without hash ids (Azure, generated workloads) raises ``ConfigError``."""
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ConfigError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if not entry.hash_ids:
        raise ConfigError("prompt_token_ids needs an entry with hash_ids (a Mooncake trace)")
    tokens: List[int] = []
    for hash_id in entry.hash_ids:
        tokens.extend(_block_tokens(seed, hash_id, vocab_size))
    return tuple(tokens[:entry.prompt_len])


def _block_tokens(seed: int, hash_id: int, vocab_size: int) -> List[int]:
    rng = random.Random(f"vmemkv-trace-block:{seed}:{hash_id}")
    return [rng.randrange(1, vocab_size) for _ in range(MOONCAKE_BLOCK_TOKENS)]


def fit_to_length(entries: List[TraceEntry], max_total_len: int) -> Tuple[List[TraceEntry], int]:
    """``entries`` with every request longer than ``max_total_len`` tokens (prompt + output)
    scaled down to it, prompt and output in proportion (each at least 1 token; hash ids cut to
    the blocks the shorter prompt still has), and how many were scaled. Shorter ones are kept."""
    if isinstance(max_total_len, bool) or not isinstance(max_total_len, int) or max_total_len < 2:
        raise ConfigError(f"max_total_len must be an int >= 2, got {max_total_len!r}")
    out, scaled = [], 0
    for e in entries:
        if e.total_len <= max_total_len:
            out.append(e)
            continue
        prompt, output = scale_to_length(e.prompt_len, e.output_len, max_total_len)
        blocks = -(-prompt // MOONCAKE_BLOCK_TOKENS)
        out.append(replace(e, prompt_len=prompt, output_len=output, hash_ids=e.hash_ids[:blocks]))
        scaled += 1
    return out, scaled
