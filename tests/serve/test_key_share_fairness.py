"""A per-key cap (``--max-requests-per-key``) that is not below a bound of the whole server's
requests in flight was accepted silently, and then did nothing: at N >= ``--max-queue`` one key
could still take every slot of the queue, at N >= ``--max-connections`` every connection (each
HTTP request in flight holds one), and every other key got 503 until it let go. Now such a cap
is refused at start, naming both flags (the CLI exits 2 before the model loads)."""
from __future__ import annotations

import pytest

from vmemkv.cli import main
from vmemkv.runtime.serve import Server, ServeConfigError
from vmemkv.runtime.serve.auth import AuthConfig
from vmemkv.runtime.serve.limits import ServeLimits
from vmemkv.runtime.serve.in_flight import RequestsInFlight, check_max_requests_per_key


@pytest.mark.parametrize("max_per_key", [4, 5])
def test_a_per_key_cap_at_or_past_the_queue_is_refused_naming_both_flags(max_per_key):
    with pytest.raises(ServeConfigError) as refused:
        RequestsInFlight(max_requests=4, max_per_key=max_per_key)
    assert str(refused.value).startswith(
        f"--max-requests-per-key {max_per_key} must be less than --max-queue 4: at 4 or more "
        f"one API key can still take every slot of the queue, and every other key gets 503")
    with pytest.raises(ServeConfigError, match=f"--max-requests-per-key {max_per_key} must be "
                                               f"less than --max-queue 4"):
        Server(None, "m", port=0, max_queue=4, auth=AuthConfig(("k",)),
               max_requests_per_key=max_per_key)


def test_a_per_key_cap_below_every_bound_is_accepted_and_the_bounds_are_checked_apart():
    in_flight = RequestsInFlight(max_requests=4, max_per_key=3)       # one below: room left
    assert (in_flight.max_requests, in_flight.max_per_key) == (4, 3)
    check_max_requests_per_key(3, ("k",), max_queue=4, max_connections=4)
    check_max_requests_per_key(None, (), max_queue=1, max_connections=1)   # no cap: no check
    with pytest.raises(ServeConfigError, match=r"^--max-requests-per-key 4 must be less than "
                                               r"--max-connections 4: at 4 or more one API key "
                                               r"can still take every connection"):
        check_max_requests_per_key(4, ("k",), max_queue=100, max_connections=4)
    with pytest.raises(ServeConfigError, match="less than --max-connections 4"):
        Server(None, "m", port=0, max_queue=100, auth=AuthConfig(("k",)),
               limits=ServeLimits(max_connections=4), max_requests_per_key=4)


@pytest.mark.parametrize("flags, named", [
    (["--max-queue", "8", "--max-requests-per-key", "8"], "less than --max-queue 8"),
    (["--max-connections", "4", "--max-requests-per-key", "6"], "less than --max-connections 4"),
])
def test_the_cli_refuses_a_per_key_cap_at_a_server_bound_before_the_model_loads(
        flags, named, capsys, monkeypatch):
    monkeypatch.delenv("VMEMKV_API_KEY", raising=False)
    code = main(["serve", "--api-key", "k", "--port", "0", "--log-level", "critical",
                 "--model", "no-such-model-is-ever-loaded", *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert f"ServeConfigError: --max-requests-per-key {flags[-1]} must be {named}" in err
