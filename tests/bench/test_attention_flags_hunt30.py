"""``benchmarks/attention.py`` refuses before it measures anything: ``--heads`` that is not a
multiple of ``--kv-heads`` (an AttentionShapeError at the first call, after seconds of
yardsticks), and ``--layers`` where no interleaved cache is timed (it was ignored in silence:
the row stride of a cache the run never builds)."""
from __future__ import annotations

import pytest

from vmemkv.benchmarks import attention


@pytest.mark.parametrize("argv, message", [
    (["--heads", "3", "--kv-heads", "2"], "--heads 3 must be a multiple of --kv-heads 2"),
    (["--quick", "--heads", "3"], "--heads 3 must be a multiple of --kv-heads {quick}"),
    (["--layers", "4"], "--layers sets the interleaved cache's row stride and --vmem-layout "
     "per-layer times no interleaved cache: add interleaved to --vmem-layout or drop --layers"),
])
def test_a_shape_or_flag_the_run_cannot_use_is_refused_before_it_measures(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        attention.parse_args(["--device", "cpu", *argv])
    assert exit_.value.code == 2
    # --quick's K/V heads as they are now (a smoke run in this process shrinks QUICK: 2)
    message = message.format(quick=attention.QUICK["kv_heads"])
    assert f"error: {message}" in capsys.readouterr().err

