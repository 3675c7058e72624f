"""``vmemkv serve`` refuses the cache flags ``generate`` refuses once the model is known, before
the engine is built or a port is bound: a swap space that holds no token (it was accepted: no
sequence could ever swap out), a ``--max-cache-bytes`` past the device's memory (page ids are
reserved for it: a 1 TiB ceiling hung for minutes)."""
from __future__ import annotations

from vmemkv.cli import main
from vmemkv.runtime import memory


def serve(argv, capsys):
    code = main(["serve", "--model", "tiny-llama", "--port", "0", "--log-level", "critical",
                 *argv])
    return code, capsys.readouterr().err


def test_a_swap_space_that_holds_no_token_is_refused(capsys):
    code, err = serve(["--preemption", "swap", "--swap-bytes", "511"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "GenerateUsageError: --swap-bytes 511 holds no token" in err


def test_a_max_cache_bytes_past_the_device_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 64 * 2**20)
    code, err = serve(["--max-cache-bytes", "128MiB"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "CacheTooLargeError: --max-cache-bytes 134217728 needs 134217728 bytes" in err
