"""vmemkv bench serve --out is checked before any request is sent (it was checked by writing
serve.json after the whole load test: a file at DIR, or '', lost every figure)."""
import os

import pytest

from vmemkv.cli import main


@pytest.mark.parametrize("case", ["file", "empty", "member"])
def test_bench_serve_refuses_an_out_it_cannot_write_before_the_load(tmp_path, capsys, case):
    out = {"file": tmp_path / "notadir", "empty": "", "member": tmp_path / "b"}[case]
    if case == "file":
        out.write_text("a file, not a folder")
    if case == "member":
        (out / "serve.json").mkdir(parents=True)
    # port 9 (discard) has no server: a run that got past the check would fail connecting
    code = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--rate", "8",
                 "--num-prompts", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("vmemkv bench: error: --out ")
    assert {"file": f"--out {out} is not a folder (a file is there): give a folder",
            "empty": "--out needs a folder name, got ''",
            "member": f"{tmp_path / 'b' / 'serve.json'} is not a regular file"}[case] in err
    if case == "file":
        assert out.read_text() == "a file, not a folder"
    if case == "member":
        assert os.listdir(out) == ["serve.json"]
