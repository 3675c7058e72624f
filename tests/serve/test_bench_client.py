"""vmemkv bench serve builds every prompt before it sends the first, so the prompts' tokens are
checked against available memory before any is built (--num-prompts 100000 --input-len 100000
built 10^10 token ids: a bare MemoryError after 1.46 GB under a 1.5 GB cap, about 80 GB
without). Available memory is faked; the loads are small."""
import json
import socket

import pytest

from vmemkv.cli import main
from vmemkv.runtime.serve import bench_client
from vmemkv.runtime.serve.bench_client import (PROMPT_TOKEN_BYTES, poisson_requests,
                                               trace_requests)
from vmemkv.runtime.serve.errors import ServeConfigError
from vmemkv.scheduler import sim_memory

AVAILABLE_BYTES = 1 << 20          # 16,384 prompt tokens at 64 bytes


@pytest.fixture
def small_host(monkeypatch):
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: AVAILABLE_BYTES)


def test_poisson_prompts_that_do_not_fit_are_refused_before_any_is_built(small_host, monkeypatch):
    monkeypatch.setattr(bench_client.random, "Random", None)     # nothing may be drawn
    with pytest.raises(ServeConfigError) as refused:
        poisson_requests(float("inf"), 100, 200, 4, 32000)
    assert str(refused.value).startswith(
        "num_prompts 100 x input_len 200 (--num-prompts x --input-len) is 20,000 prompt tokens, "
        f"built before the first request is sent: about {20_000 * PROMPT_TOKEN_BYTES} bytes")
    assert f"MemAvailable of {AVAILABLE_BYTES} bytes" in str(refused.value)
    assert str(refused.value).endswith("lower --num-prompts or --input-len")


def test_poisson_prompts_that_fit_are_the_same_as_before(monkeypatch):
    unchecked = poisson_requests(4.0, 100, 160, 4, 32000, seed=3)       # 16,000 tokens
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: 16_000 * PROMPT_TOKEN_BYTES)
    assert poisson_requests(4.0, 100, 160, 4, 32000, seed=3) == unchecked
    assert len(unchecked) == 100 and {len(r.prompt_ids) for r in unchecked} == {160}
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: 16_000 * PROMPT_TOKEN_BYTES - 1)
    with pytest.raises(ServeConfigError, match="16,000 prompt tokens"):
        poisson_requests(4.0, 100, 160, 4, 32000, seed=3)


def test_trace_prompts_are_checked_after_max_requests_and_max_total_len(tmp_path, monkeypatch):
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: 2 << 20)   # the trace fits
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt_len": 1000, "output_len": 10, "arrival_s": i})
                            + "\n" for i in range(50)))
    with pytest.raises(ServeConfigError) as refused:       # 50,000 tokens: 3.2 MB
        trace_requests(str(path), 50, 1.0, 4096, 32000)
    assert (f"the 50 requests of trace {path} (--max-requests 50, --max-total-len 4,096) is "
            f"50,000 prompt tokens") in str(refused.value)
    assert "lower --max-requests or --max-total-len" in str(refused.value)
    assert sum(len(r.prompt_ids) for r in trace_requests(str(path), 10, 1.0, 4096, 32000)) == 10_000
    shorter = trace_requests(str(path), 50, 1.0, 200, 32000)   # scaled to 200 tokens each
    assert sum(len(r.prompt_ids) for r in shorter) <= 50 * 200


def test_bench_serve_too_big_is_one_line_exit_2_before_the_server_is_asked(small_host, capsys,
                                                                          tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    code = main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--rate", "inf",
                 "--num-prompts", "1000", "--input-len", "1000", "--no-plots", "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "ServeConfigError" in err and "(--num-prompts x --input-len) is 1,000,000" in err
    assert "cannot list the models" not in err
