"""Two vmem schedulers on one MemoryBudget, requests with and without LoRA adapters, against
liveness: a hypothesis state machine over submissions, steps (each after the budget's decide
and a partial resize, as the engine and the simulator run them) and the idle clock.

After every rule: the budget's bytes are the two pools' and never exceed its total; each
adapter's uses are its running sequences; each manager's integrity check holds. A submission
refused is one that could never fit: past the most its pool has held (beside its adapter, which
takes pages from the same pool). Clients abort requests at any point. At the end, with no more submissions, both
are stepped while the clock runs: every request accepted and not aborted finishes (none waits for ever: the budget grows a pool
for its head request's tokens and adapter, and an idle pool gives its memory back).

Both pools have held 256 of the budget's 384 tokens before the first request, so a request may
need up to 256 tokens: two of them cannot run at once. Before the budget's liveness rule (an
older blocked share is yielded to, preempting if need be) the machine's requests never needed
more than 64 tokens and missed the deadlock two such requests made: each pool grew part way,
each waited for the other's pages, and neither gave (each had a request waiting).
"""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import RequestTooLargeError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from ..hypothesis_budget import examples
from .adapter_sched import PAGE, TINY, check_pins, ref

BPT = TINY.bytes_per_token
ADAPTERS = (None, ref("s", "s-1", 8 * BPT), ref("m", "m-1", 24 * BPT), ref("l", "l-1", 48 * BPT))
LANES = (("per-layer", "recompute"), ("interleaved", "swap"))
MAX_LEN = 256                      # tokens of one sequence: two of them overflow the budget


def resize(sched, share, cache_bytes: int, preempt: bool = False) -> None:
    """One budget resize as the engine does it: partial, in a transaction, then settled."""
    sched.begin()
    sched.manager.begin()
    sched.resize(cache_bytes, preempt, partial=True)
    sched.manager.commit()
    sched.commit()
    share.settle(sched.manager.cache_bytes)


class BudgetLiveness(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.budget = MemoryBudget(384 * BPT, idle_release_s=1.0, clock=lambda: self.now)
        self.lanes, self.accepted, self.aborted = [], [], set()
        for i, (layout, preemption) in enumerate(LANES):
            mgr = make_manager("vmem", TINY, 256 * BPT, MAX_LEN, page_bytes=PAGE,
                               layout=layout, swap_bytes=512 * BPT, max_cache_bytes=256 * BPT)
            share = self.budget.register(f"lane{i}", 32 * BPT, 256 * BPT, (256 - 128 * i) * BPT)
            sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=MAX_LEN,
                                                   preemption=preemption))
            sched.growable = True
            self.lanes.append((sched, share))
            self.accepted.append([])
        (first, a), (second, b) = self.lanes       # each has held 256 tokens, both hold 128
        resize(first, a, 128 * BPT)
        resize(second, b, 256 * BPT)
        resize(second, b, 128 * BPT)
        assert first.max_fit_tokens == second.max_fit_tokens == MAX_LEN
        self.next_id = 0
        self.preempted = [False] * len(LANES)   # the lane's last step preempted

    def _turn(self, lane: int) -> None:
        """The budget decides, the pool resizes (partial, one transaction), then one step."""
        sched, share = self.lanes[lane]
        preempted = sched.metrics.num_preemptions
        target = share.decide(sched, preempted=self.preempted[lane])
        if target is not None and target != sched.manager.cache_bytes:
            resize(sched, share, min(target, sched.manager.max_cache_bytes), share.preempts)
        else:
            share.settle(sched.manager.cache_bytes)      # what decide reserved goes back
        if sched.has_unfinished():
            plan = sched.schedule()
            sched.update({s.seq_id: 1 for s in plan.seqs if s.sample})
        self.preempted[lane] = sched.metrics.num_preemptions > preempted

    @initialize(idle=st.lists(st.booleans(), min_size=2, max_size=2))
    def start(self, idle):
        """Lanes that start idle past ``idle_release_s``: shrunk to their minimum (32 tokens),
        as a server's pool is before its first request."""
        for lane in (i for i, shrink in enumerate(idle) if shrink):
            self._turn(lane)                 # idle from now
        self.now += 1.5
        for lane in (i for i, shrink in enumerate(idle) if shrink):
            self._turn(lane)                 # given back
            assert self.lanes[lane][0].manager.cache_bytes == 32 * BPT

    @rule(lane=st.integers(0, 1), prompt=st.integers(1, 40), new=st.integers(1, 24),
          adapter=st.sampled_from(ADAPTERS), large=st.integers(0, 4))
    def submit(self, lane, prompt, new, adapter, large):
        prompt += 44 * large              # large 4: up to 216 + 24 tokens, past half the budget
        sched, _ = self.lanes[lane]
        request = Request(self.next_id, prompt_len=prompt, max_tokens=new, adapter=adapter)
        self.next_id += 1
        try:
            ids = sched.add_request(request)
        except RequestTooLargeError:
            fit = sched.max_fit_tokens if adapter is None else \
                sched.manager.max_sequence_tokens_with_adapter(adapter, sched.max_fit_bytes)
            assert prompt + new > min(fit, sched.max_seq_len), (prompt, new, fit)
            return
        self.accepted[lane].extend((request.request_id, i) for i in ids)

    @rule(lane=st.integers(0, 1), pick=st.integers(0, 10**6))
    def abort(self, lane, pick):
        """A client goes away: its request ends wherever it is (waiting, running, swapped, or
        the one its share is blocked for)."""
        sched, _ = self.lanes[lane]
        live = sorted({r for r, i in self.accepted[lane] if not sched.seqs[i].state.is_ended})
        if live:
            request_id = live[pick % len(live)]
            sched.abort_request(request_id)
            self.aborted.add(request_id)

    @rule(lane=st.integers(0, 1), count=st.integers(1, 6))
    def step(self, lane, count):
        for _ in range(count):
            self._turn(lane)

    @rule(seconds=st.sampled_from([0.25, 1.5]))
    def tick(self, seconds):
        self.now += seconds

    @invariant()
    def accounted(self):
        assert self.budget.held_bytes == sum(s.manager.cache_bytes for s, _ in self.lanes) \
            <= self.budget.total_bytes
        for sched, share in self.lanes:
            assert share.held_bytes == sched.manager.cache_bytes
            check_pins(sched)
            sched.manager.check_integrity()

    def teardown(self):
        """Step both while the clock runs, until nothing is unfinished or nothing moved for
        40 rounds (10 s of clock, ten times ``idle_release_s``): a request waiting for ever."""
        progress, still, rounds = None, 0, 0
        while any(s.has_unfinished() for s, _ in self.lanes) and still < 40 and rounds < 4000:
            rounds += 1
            for lane in range(len(self.lanes)):
                self._turn(lane)
            self.now += 0.25
            now = tuple((s.metrics.generated_tokens, s.manager.cache_bytes) for s, _ in self.lanes)
            progress, still = now, (still + 1 if now == progress else 0)
        for (sched, _), ids in zip(self.lanes, self.accepted):
            stuck = [i for r, i in ids if r not in self.aborted
                     and sched.seqs[i].state is not SeqState.FINISHED]
            assert not stuck, (f"never finished: {stuck}, pool "
                               f"{sched.manager.cache_bytes // BPT} tokens")


TestBudgetLiveness = BudgetLiveness.TestCase
TestBudgetLiveness.settings = settings(max_examples=examples(200), stateful_step_count=30,
                                       deadline=None)
