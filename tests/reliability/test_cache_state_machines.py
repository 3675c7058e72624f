"""Random admit/grow/fork/prefix-share/preempt/swap/free sequences through a manager and its
cache, one layout per state machine, with integrity and a content check against the shadow
after every step. A rule also injects a driver fault (vmem) into a step and checks that the
step rolled back completely and then succeeds when retried.
"""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmemkv.runtime.errors import PlanExecutionError

from .model import VOCAB, CacheModel
from ..hypothesis_budget import examples as budget

ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)


class CacheMachine(RuleBasedStateMachine):
    layout = "vmem-per-layer"

    def __init__(self) -> None:
        super().__init__()
        self.model = CacheModel(self.layout)

    def teardown(self) -> None:
        self.model.close()

    def _pick(self, seqs, index):
        keys = sorted(seqs)
        return keys[index % len(keys)]

    @rule(prompt=ids)
    def admit(self, prompt):
        self.model.step(self.model.admit(prompt))

    @precondition(lambda self: self.model.tokens)
    @rule(index=st.integers(0, 99), keep=st.integers(0, 64), tail=ids)
    def admit_sharing_prefix(self, index, keep, tail):
        donor = self.model.tokens[self._pick(self.model.tokens, index)]
        self.model.step(self.model.admit((donor[:keep] + tail)[:48]))

    @precondition(lambda self: self.model.tokens)
    @rule(index=st.integers(0, 99), new=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
    def grow(self, index, new):
        self.model.step(self.model.grow(self._pick(self.model.tokens, index), new))

    @precondition(lambda self: self.model.tokens)
    @rule(index=st.integers(0, 99))
    def fork(self, index):
        self.model.step(self.model.fork(self._pick(self.model.tokens, index)))

    @precondition(lambda self: self.model.tokens)
    @rule(index=st.integers(0, 99), swap=st.booleans())
    def preempt(self, index, swap):
        self.model.step(self.model.preempt(self._pick(self.model.tokens, index), swap))

    @precondition(lambda self: self.model.swapped)
    @rule(index=st.integers(0, 99))
    def swap_in(self, index):
        self.model.step(self.model.swap_in(self._pick(self.model.swapped, index)))

    @precondition(lambda self: self.model.tokens or self.model.swapped)
    @rule(index=st.integers(0, 99))
    def free(self, index):
        seqs = {**self.model.tokens, **self.model.swapped}
        self.model.step(self.model.free(self._pick(seqs, index)))

    @precondition(lambda self: self.model.driver is not None and self.model.tokens)
    @rule(action=st.sampled_from(["admit", "grow", "swap_in"]), kind=st.sampled_from(["map", "unmap", "copy"]),
          call=st.integers(0, 2), index=st.integers(0, 99), new=ids)
    def step_with_fault(self, action, kind, call, index, new):
        m = self.model
        if action == "admit":
            mutate = m.admit(new)
        elif action == "grow":
            mutate = m.grow(self._pick(m.tokens, index), new[:8])
        elif m.swapped:
            mutate = m.swap_in(self._pick(m.swapped, index))
        else:
            mutate = m.fork(self._pick(m.tokens, index))
        before = m.snapshot()
        m.driver.fail_at(kind, call)
        try:
            m.step(mutate)
        except PlanExecutionError as error:
            assert error.rolled_back
            assert m.snapshot() == before
            m.check()
            m.count("fault_rolled_back")
            m.step(mutate)                 # the same step, retried, succeeds
        finally:
            m.driver.disarm()

    @invariant()
    def consistent(self):
        self.model.check()


def machine_test(layout: str, examples: int = 200, steps: int = 20):
    machine = type(f"Machine_{layout.replace('-', '_')}", (CacheMachine,), {"layout": layout})
    test = machine.TestCase
    test.settings = settings(max_examples=budget(examples),
                             stateful_step_count=steps, deadline=None)
    return test


TestVmemPerLayer = machine_test("vmem-per-layer")
TestVmemInterleaved = machine_test("vmem-interleaved")
TestVmemPerLayerMapper = machine_test("vmem-per-layer-mapper")
TestVmemInterleavedMapper = machine_test("vmem-interleaved-mapper")
TestPaged = machine_test("paged")
# pages that hold no whole token: groups backed by their bytes (MapExtent / UnmapExtent of member pages), page for page
TestVmemStraddlingMapper = machine_test("vmem-straddling-mapper", examples=40)
TestVmemInterleavedStraddling = machine_test("vmem-interleaved-straddling", examples=40)


@pytest.mark.parametrize("layout", ["vmem-per-layer", "vmem-interleaved", "paged"])
def test_random_mix_covers_every_event(layout):
    """The rules' building blocks really produce prefix hits, CoW forks, swaps and reclaims."""
    import random
    rng = random.Random(5)
    m = CacheModel(layout)
    hits = 0
    for _ in range(300):
        roll = rng.random()
        if roll < 0.3 or not m.tokens:
            donor = m.tokens[rng.choice(sorted(m.tokens))] if m.tokens and rng.random() < 0.6 else []
            prompt = (donor[:rng.randint(0, 48)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))])[:48]
            before = m.manager.prefix_hits
            m.step(m.admit(prompt))
            hits += m.manager.prefix_hits - before
        elif roll < 0.6:
            m.step(m.grow(rng.choice(sorted(m.tokens)), [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]))
        elif roll < 0.7:
            m.step(m.fork(rng.choice(sorted(m.tokens))))
        elif roll < 0.85:
            m.step(m.preempt(rng.choice(sorted(m.tokens)), rng.random() < 0.7))
        elif m.swapped:
            m.step(m.swap_in(rng.choice(sorted(m.swapped))))
        m.check()
    m.close()
    assert hits > 0
    for event in ("admit", "grow", "fork", "swap_out", "swap_in", "free"):
        assert m.events.get(event, 0) > 0, (event, m.events)
