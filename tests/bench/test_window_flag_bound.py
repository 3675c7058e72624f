"""``benchmarks/window.py --window`` is bounded where its cache (16x the window at 16 KiB a
token) still fits a host: 100000 failed after parsing with a CacheTooLargeError naming
``max_context``, a field the user never gave; it is refused while parsing, naming the flag."""
import pytest

from vmemkv.benchmarks import window


@pytest.mark.parametrize("value", ["100000", "0", "10**18"])
def test_a_window_out_of_range_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        window.main(["--window", value])
    assert exit_.value.code == 2
    assert "argument --window:" in capsys.readouterr().err
