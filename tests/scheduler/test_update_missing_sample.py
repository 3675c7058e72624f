"""``Scheduler.update`` with no token for a sequence the step's plan sampled: it raised a bare
KeyError after appending the tokens of the sequences before it, so the caller's retry with the
full dict appended theirs twice. It is now a SchedulerError naming the sequences, raised before
anything is recorded: the retry records exactly one token per sequence."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.errors import SchedulerError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import MODELS
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

SPEC = MODELS["llama-3-8b"]


@pytest.mark.parametrize("policy", ["paged", "vmem", "reserve-max"])
@pytest.mark.parametrize("decoding", [False, True], ids=["prefill", "decode"])
def test_a_missing_token_is_refused_before_anything_is_recorded(policy, decoding):
    manager = make_manager(policy, SPEC, 4 * 512 * SPEC.bytes_per_token, 512, page_bytes=2**16)
    sched = Scheduler(manager, SchedulerConfig())
    for rid in range(3):
        sched.add_request(Request(rid, 10, 5))
    sched.schedule()
    if decoding:                      # the next step's sequences are on the decode path
        sched.update({0: 7, 1: 7, 2: 7})
        sched.schedule()
    before = {sid: (list(seq.output), seq.num_computed) for sid, seq in sched.seqs.items()}
    generated = sched.metrics.generated_tokens
    with pytest.raises(SchedulerError, match=r"sampled has no token for sequence\(s\) \[2\] "
                                             r"\(1 in all\)"):
        sched.update({0: 1, 1: 2})
    assert {sid: (list(seq.output), seq.num_computed) for sid, seq in sched.seqs.items()} == before
    assert sched.metrics.generated_tokens == generated
    sched.update({0: 1, 1: 2, 2: 3})
    assert [len(sched.seqs[sid].output) for sid in range(3)] == [1 + decoding] * 3
    manager.check_integrity()
