"""A trace file that begins with a UTF-8 byte-order mark (spreadsheet programs save CSV with
one) reads as the same file without it: the mark was read as part of the first line, and an
Azure CSV was refused ("expected the header TIMESTAMP,..., got '\\ufeffTIMESTAMP,...'") and a
JSONL trace's first line was not JSON."""
from __future__ import annotations

import codecs
import gzip

import pytest

from vmemkv.scheduler.traces import load_trace

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,396,109\n")
JSONL = ('{"prompt_len": 12, "output_len": 3, "arrival_s": 0.0}\n'
         '{"prompt_len": 40, "output_len": 7, "arrival_s": 1.5}\n')


@pytest.mark.parametrize("name, text", [("t.csv", AZURE), ("t.jsonl", JSONL),
                                        ("t.jsonl.gz", JSONL)])
def test_a_leading_byte_order_mark_is_not_part_of_the_trace(tmp_path, name, text):
    def write(path, data: bytes):
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    plain, marked = tmp_path / name, tmp_path / ("bom-" + name)
    write(plain, text.encode())
    write(marked, codecs.BOM_UTF8 + text.encode())
    assert load_trace(str(marked)) == load_trace(str(plain))
    assert len(load_trace(str(marked))) == 2
