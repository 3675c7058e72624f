"""`vmemkv serve` and `vmemkv bench serve` from the command line: the server answers, Ctrl-C
exits 130; bench serve reports vllm bench serve's names (table, serve.json, serve.png) for
Poisson and trace arrivals; user errors are one line, exit 2."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys

import pytest

from vmemkv.cli import main
from vmemkv.runtime.serve.bench_client import poisson_requests

from . import local_http
from ..signals import sigint_as_ctrl_c
from .conftest import VMEM, serving


def test_serve_answers_and_ctrl_c_exits_130():
    command = [sys.executable, "-m", "vmemkv.cli", "serve", "--port", "0", "--threads", "1",
               "--max-context", "128", "--log-level", "info"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_ctrl_c)
    try:
        port = None
        for line in proc.stderr:   # uvicorn names the port it took
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if match:
                port = int(match.group(1))
                break
        assert port, "the server never said where it listens"
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        got = local_http.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).json()
        assert len(got["choices"][0]["token_ids"]) == 3
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "vmemkv serve: interrupted" in rest


def test_serve_on_a_taken_port_is_one_line_exit_2(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code = main(["serve", "--port", str(taken.getsockname()[1]), "--max-context", "64",
                     "--log-level", "critical"])
    last = capsys.readouterr().err.splitlines()[-1]   # after the start-up line
    assert code == 2 and last.startswith("vmemkv serve: error: ServeConfigError: could not "
                                          "listen on 127.0.0.1:")


@pytest.mark.parametrize("load", [["--rate", "inf", "--num-prompts", "8", "--input-len", "5"],
                                  ["--trace", "mooncake-synthetic", "--max-requests", "8",
                                   "--rate-scale", "1000", "--max-total-len", "40"]],
                         ids=["poisson", "trace"])
def test_bench_serve_reports_vllm_names_as_table_json_and_plot(load, tmp_path, capsys):
    with serving(VMEM) as (server, _):
        code = main(["bench", "serve", "--url", server.url, *load, "--output-len", "4",
                     "--goodput", "ttft:60000", "--out", str(tmp_path), "--label", "vmem"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads((tmp_path / "serve.json").read_text())["report"]
    assert report["completed"] == 8 and report["failed"] == 0
    for name in ("request_throughput", "output_throughput", "total_token_throughput",
                 "request_goodput", "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms"):
        assert report[name] is not None and report[name] > 0, name
    if load[0] == "--rate":
        assert report["total_output_tokens"] == 32 and report["total_input_tokens"] == 40
    assert "request_throughput" in out and re.search(r"ttft ms \|", out)
    assert (tmp_path / "serve.png").stat().st_size > 1000


def test_bench_serve_against_nothing_is_one_line_exit_2(tmp_path, capsys):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    code = main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--rate", "1", "--no-plots",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot list the models" in err


def test_poisson_arrivals_are_open_loop_and_seeded():
    a = poisson_requests(4.0, 50, 3, 2, 256, seed=1)
    assert a == poisson_requests(4.0, 50, 3, 2, 256, seed=1)
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and times[0] == 0.0 and 5 < times[-1] < 25   # mean gap 1/4 s
    assert {r.arrival_s for r in poisson_requests(float("inf"), 5, 3, 2, 256)} == {0.0}
