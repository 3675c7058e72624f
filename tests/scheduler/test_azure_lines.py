"""An Azure CSV trace is named by its file lines: a quoted field holding a line break ("396
then " on the next line) is refused naming the line it starts on (it was read as 396, and every
later error named a line one too early: rows were counted, not lines), and text the csv module
cannot read is a ConfigError naming its line, not an untyped csv.Error."""
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.traces import load_trace

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:15:46.6805900,374,44\n"


def load(tmp_path, text: str, newline: str = "\n"):
    path = tmp_path / "t.csv"
    path.write_bytes(text.replace("\n", newline).encode())
    return load_trace(str(path))


@pytest.mark.parametrize("text, match", [
    (HEADER + ROW + '2023-11-16 18:15:50.9951690,"396\n",4\n' + ROW,
     r"t.csv line 3: a quoted field holds a line break \(the row runs on to line 4\); an "
     r"Azure row is one line"),
    (HEADER + ROW + '2023-11-16 18:15:50.9951690,"3\n\n\n96",4\n',
     r"t.csv line 3: .*\(the row runs on to line 6\)"),
    (HEADER + ROW + '2023-11-16 18:15:50.9951690,396,"4\n',
     r"t.csv line 3: a quoted field holds a line break \(its quote never closes\)"),
    (HEADER + ROW + "2023-11-16 18:15:50.9951690," + "9" * 200_000 + ",4\n",
     r"t.csv line 3: not CSV \(field larger than field limit"),
])
def test_a_row_that_is_not_one_csv_line_is_refused_naming_its_line(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load(tmp_path, text)


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_bad_row_is_named_by_its_file_line_after_blank_lines(tmp_path, newline):
    text = HEADER + ROW + "\n" + ROW + "\n\n" + "2023-11-16 18:15:51.0,396,x\n"
    with pytest.raises(ConfigError, match=r"t.csv line 7: GeneratedTokens must be an int .* "
                                          r"got 'x'"):
        load(tmp_path, text, newline)


def test_one_line_rows_still_load(tmp_path):
    assert [e.prompt_len for e in load(tmp_path, HEADER + ROW + "\n" + ROW, "\r\n")] == [374, 374]
