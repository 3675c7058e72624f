"""A trace file read as a stream of text, what loading it may hold checked as it is read.

``load_trace`` read a file whole, gunzipped it whole and decoded it whole before parsing a line,
and kept ``max_requests`` only after parsing them all: a 6 MB gzip of newlines that inflates to
6 GiB committed 3.75 GB before a MemoryError. ``text_lines`` inflates and reads at most
``READ_CHUNK_BYTES`` at a time (a longer line is gathered in pieces), and the loader stops
asking at the line after the first ``max_requests`` (``traces._parse``). The lines of each chunk
are charged before any is parsed: ``ENTRY_BYTES`` a line (any line may become a request; an
empty one is charged too, so a file of newlines is refused as well) plus ``TEXT_BYTE_CHARGE``
bytes a byte of text. Measured with tracemalloc (2026-12-06), a loaded request holds 170-200
bytes on the bundled Azure traces (37 bytes of text a line) and 1,060-1,280 on the Mooncake ones
(250-285 bytes of text a line: a hash id is about 7 characters and 36 bytes held, a tuple slot
and an int); the charge is 660 and 1,520-1,650. When the charge passes what was last checked,
``sim_memory.check_host_need`` checks it plus ``CHECK_STEP_BYTES`` against the host's
MemAvailable, so a file too big is refused (``SimulationTooLargeError``, naming the file, the
lines and bytes read and the bytes needed) with at most a chunk read past what fits and nothing
parsed from it: a gzip of 512 MiB of newlines was refused in 0.8 s at 30 MB resident on a host
with 21 GB available.
"""
from __future__ import annotations

import codecs
import gzip
import io
import itertools
import re
import zlib
from typing import BinaryIO, Iterator, List, Tuple

from .errors import ConfigError
from .sim_memory import ENTRY_BYTES, check_host_need

READ_CHUNK_BYTES = 1 << 20     # most inflated bytes read at once; a longer line comes in pieces
CHECK_STEP_BYTES = 1 << 20     # memory is checked this far ahead of the charge
TEXT_BYTE_CHARGE = 4           # bytes charged a byte of text read (a hash id: 36 held, 7 read)
_NEWLINES = re.compile(rb"\n*")
REMEDY = "keep fewer requests (max_requests, --max-requests) or give a smaller trace"


class TraceCharge:
    """What reading one trace may hold, checked against available memory before it is held."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.lines = self.text_bytes = self.need_bytes = self.checked_bytes = 0

    def take(self, text_bytes: int, lines: int) -> None:
        """Charge ``text_bytes`` more of text and ``lines`` more lines; SimulationTooLargeError
        (nothing parsed from them yet) when the charge and a step more do not fit."""
        self.lines += lines
        self.text_bytes += text_bytes
        self.need_bytes += lines * ENTRY_BYTES + text_bytes * TEXT_BYTE_CHARGE
        if self.need_bytes > self.checked_bytes:
            self.checked_bytes = self.need_bytes + CHECK_STEP_BYTES
            check_host_need(f"reading trace {self.where} ({self.lines:,} lines and "
                            f"{self.text_bytes:,} bytes of text read so far, and "
                            f"{CHECK_STEP_BYTES:,} bytes more)", self.checked_bytes, REMEDY)


def text_lines(raw: BinaryIO, where: str, gz: bool, one_line_each: bool) -> Iterator[str]:
    """The text of the file ``raw`` (gunzipped when ``gz``), read as it is asked for: one line
    each, with its ``\\n`` (the last may have none), with ``one_line_each`` (for csv.reader);
    otherwise blocks of whole lines, the lines of a chunk at once and a run of empty lines as
    one string of its newlines, so that a file of newlines is charged and refused at C speed
    (a line at a time, 44 M lines took 56 s; ``numbered_lines`` of the blocks numbers the lines
    as it numbers the whole text). A ConfigError names ``where`` for a file that is not a whole
    gzip, cannot be read or is not UTF-8; SimulationTooLargeError when what was read does not
    fit (``TraceCharge``), before it is yielded. A leading UTF-8 byte-order mark is dropped."""
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
    charge, pieces = TraceCharge(where), []   # pieces: a line longer than what a chunk holds
    chunk, at, first = b"", 0, True
    while True:
        if at == len(chunk):
            chunk, at = _read_chunk(stream, where, gz), 0
            if not chunk:
                break
            if first and chunk.startswith(codecs.BOM_UTF8):   # a spreadsheet's CSV begins
                at = len(codecs.BOM_UTF8)                     # with one: not the header's text
            first = False
            if at == len(chunk):
                continue
        blank = 0 if pieces else _NEWLINES.match(chunk, at).end() - at  # empty lines from at
        if blank:
            charge.take(blank, blank)
            at += blank
            yield from itertools.repeat("\n", blank) if one_line_each else ("\n" * blank,)
            continue
        end = chunk.rfind(b"\n", at) + 1                    # after the chunk's last line
        block, at = chunk[at:end or len(chunk)], end or len(chunk)
        charge.take(len(block), block.count(b"\n"))
        if not end:
            pieces.append(block)
            continue
        if pieces:
            block = b"".join(pieces + [block])
            pieces.clear()
        text = _decode(block, where)
        yield from io.StringIO(text) if one_line_each else (text,)    # lines end at \n only
    if pieces:                                 # the last line, with no newline
        charge.take(0, 1)
        yield _decode(b"".join(pieces), where)


# str.splitlines' line breaks but U+0085, U+2028 and U+2029, which JSON allows raw in a string
# (a line holding one in an adapter's name was split there and refused as not JSON)
_LINE_BREAK = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e]")
_IN_STRING = re.compile("[\x85\u2028\u2029]")


def numbered_lines(lines: Iterator[str]) -> Iterator[Tuple[int, str]]:
    """The non-empty lines of JSONL text (``text_lines``' blocks of whole lines; a run of empty
    lines may come as one string of newlines) and their numbers, as ``str.splitlines`` numbers
    the whole text (a form feed or a lone carriage return ends a line too), but for the breaks
    a JSON string may hold (``_LINE_BREAK``)."""
    lineno = 0
    for piece in lines:
        if piece[:1] == "\n" and not piece.strip("\n"):      # a run of empty lines
            lineno += len(piece)
            continue
        for line in _split(piece):
            lineno += 1
            if line.strip():
                yield lineno, line


def _split(text: str) -> List[str]:
    """``text.splitlines()``, but at ``_LINE_BREAK``'s breaks only (a regex: 10x slower, so
    only for text holding one of the three)."""
    if not _IN_STRING.search(text):
        return text.splitlines()
    lines = _LINE_BREAK.split(text)
    return lines[:-1] if lines[-1] == "" else lines      # no line after the last break


def _decode(piece: bytes, where: str) -> str:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"trace {where}: not UTF-8 text") from None


def _read_chunk(stream: BinaryIO, where: str, gz: bool) -> bytes:
    try:
        return stream.read(READ_CHUNK_BYTES)
    except (EOFError, zlib.error) as error:               # truncated, corrupt
        raise ConfigError(f"trace {where}: not a whole gzip file ({error})") from None
    except OSError as error:
        if gz and not error.errno:                        # not gzip (BadGzipFile), corrupt
            raise ConfigError(f"trace {where}: not a whole gzip file ({error})") from None
        raise ConfigError(f"cannot read trace {where!r}: {error.strerror}") from None
