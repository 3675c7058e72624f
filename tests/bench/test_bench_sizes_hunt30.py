"""Sizes a benchmark's workload cannot take are one line naming the flag (exit 2), before or
as the run finds them, not a traceback from inside it: ``plan_size --seqs`` past what its 60 GB
cache runs at once was ``AssertionError: a pure decode step``; ``txn --pools`` too small for
its 32 running sequences (or ``--repeats`` that grow them past it) was ``OutOfCapacityError:
sequence 31 needs 13 blocks``, naming neither flag."""
from __future__ import annotations

import pytest

from vmemkv.benchmarks import plan_size, txn
from vmemkv.cli import UsageError


def test_plan_size_refuses_more_sequences_than_its_cache_admits_naming_seqs():
    with pytest.raises(UsageError, match=r"^--seqs 448: the 60 GB cache of llama-3-8b "
                                         r"\(vmem per-layer\) runs only 447 of them at once at "
                                         r"admission: give fewer --seqs"):
        plan_size.main(["--seqs", "448", "--decodes", "1"])


def test_plan_size_refuses_sequences_that_stop_fitting_while_they_decode():
    with pytest.raises(UsageError, match=r"^--seqs 447: .* runs only 446 of them at once at "
                                         r"decode step 2: give fewer --seqs \(or --decodes\)"):
        plan_size.main(["--seqs", "447", "--decodes", "64"])


@pytest.mark.parametrize("argv, message", [
    # 193 tokens + 1 committed step + 15 hot-path appends = 209 tokens: 14 units each
    (["--pools", "447", "--repeats", "1"], "--pools 447: the 32 running sequences grow to 209 "
     "tokens with --repeats 1, 448 units of 16 tokens: give --pools of at least 448"),
    (["--pools", "448", "--repeats", "17"], "--pools 448: the 32 running sequences grow to 225 "
     "tokens with --repeats 17, 480 units of 16 tokens: give --pools of at least 480"),
    (["--pools", "10000", "1000", "--repeats", "1000"], "--pools 1000: the 32 running "
     "sequences grow to 1208 tokens with --repeats 1000, 2432 units"),
    (["--pools", "100000", "--repeats", "7985"], "--repeats 7985: each timed decode step that "
     "commits grows the 32 running sequences by a token, to 8193 tokens, past the 8192 one may "
     "hold: at most --repeats 7984"),
])
def test_txn_refuses_a_pool_its_running_sequences_outgrow_naming_the_flags(argv, message,
                                                                            capsys):
    with pytest.raises(SystemExit) as exit_:
        txn.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err

