"""``benchmarks/lora_engine.py``: a size given beside ``--smoke`` is kept, as ``--model`` is
(``--smoke --requests 2`` ran 8 requests, in silence); ``--new-tokens`` 1 to 3 runs (the
warm-up's fixed 4 tokens passed ``max_context``: every such run was refused); and an engine refusal (a ``--cache-mib``
too small for a prompt beside its adapter) is one line ``lora_engine: error: ...`` on stderr,
exit 2, as every script's error (it was ``# error: ...`` on stdout)."""
from __future__ import annotations

import json

from vmemkv.benchmarks import lora_engine
from vmemkv.cli import command_status


def test_a_size_given_beside_smoke_is_kept_and_one_new_token_runs(tmp_path):
    out = tmp_path / "lora.json"
    assert lora_engine.main(["--smoke", "--requests", "2", "--new-tokens", "1", "--out",
                             str(out)]) == 0
    payload = json.loads(out.read_text())
    env = payload["environment"]
    assert (env["model"], env["requests"], env["new_tokens"], env["max_batch"],
            env["repeats"]) == ("tiny-llama", 2, 1, 4, 1)
    assert len(payload["rows"]) == 6
    assert all(row["tokens_per_request"] == [1] and row["tokens"] == 2
               for row in payload["rows"])


def test_a_cache_too_small_is_one_line_on_stderr_exit_2(capsys):
    status = command_status("lora_engine", lambda: lora_engine.main(
        ["--smoke", "--requests", "2", "--new-tokens", "1", "--cache-mib", "0.3"]))
    captured = capsys.readouterr()
    assert status == 2 and "# error" not in captured.out
    # refused when the adapter is added (it leaves no KV room), before any request is queued
    assert captured.err.startswith("lora_engine: error: EngineConfigError: add_lora: adapter ")
    assert captured.err.count("\n") == 1 and "no request could run on it" in captured.err
