"""A custom policy (``file.py:Class``) that fails is blamed by name: what its class raises while
built or run is a PolicyError naming the spec, the method and the exception with its file:line
(one line, exit 2, on the command line), a ``free`` that keeps memory is a leak of the policy's
and not a request too large; a swap run on a manager with no swap space is refused before it
runs (the docs' example forwards ``swap_bytes``); a subclass of a built-in manager is charged
its pool's host memory before it is built; results carry the spec, not an inherited built-in
name; ``simulate``'s entries and ``SimConfig``'s fields of the wrong type are ConfigErrors
naming them. The built-in managers' errors pass unchanged."""
import pathlib
import re
import sys
from pathlib import Path

import pytest

from vmemkv.cli import main
from vmemkv.scheduler import sim_memory
from vmemkv.scheduler.errors import ConfigError, PolicyError, RequestTooLargeError
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.sim_memory import SimulationTooLargeError
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry, WorkloadSpec, generate

POLICIES = '''\
from vmemkv.scheduler.managers import PagedManager, ReserveManager, VmemManager


class Mine(PagedManager):
    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=16,
                         swap_bytes=options["swap_bytes"])
        self.name = "mine"


class RaisesInAllocate(Mine):
    def allocate(self, seq_id, num_tokens, *args, **kwargs):
        if seq_id == 3:
            raise RuntimeError("my bug in allocate")  # RAISES
        return super().allocate(seq_id, num_tokens, *args, **kwargs)


class RaisesInInit(Mine):
    def __init__(self, *args, **kwargs):
        raise KeyError("no such table")  # RAISES


class NeverFrees(Mine):
    def free(self, seq_id, computed_tokens=None):
        pass


class CanAllocateLies(Mine):
    def can_allocate(self, *args, **kwargs):
        return True


class NoName(PagedManager):
    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=64)


class NotBuilt(VmemManager):
    def __init__(self, *args, **kwargs):
        raise AssertionError("built before its pool's host memory was checked")


class Reserving(ReserveManager):
    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens)
'''


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("policies") / "r3_failing_policies.py"
    path.write_text(POLICIES)
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


ENTRIES = generate(WorkloadSpec(num_requests=40))


def test_an_exception_in_a_call_names_the_spec_the_method_and_the_users_line(policies, capsys):
    spec = f"{policies}:RaisesInAllocate"
    with pytest.raises(PolicyError) as error:
        simulate(ENTRIES, SimConfig(policy=spec, cache_bytes=2 * 10**9))
    line = line_of(policies, 'raise RuntimeError("my bug')
    assert str(error.value) == (f"custom policy {spec!r}: RaisesInAllocate.allocate raised "
                                f"RuntimeError: my bug in allocate ({policies}:{line})")
    assert isinstance(error.value.__cause__, RuntimeError)
    code = main(["simulate", "--requests", "40", "--cache-gb", "2", "--no-progress",
                 "--policy", spec])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err == f"vmemkv simulate: error: PolicyError: {error.value}\n"


def test_an_exception_in_the_constructor_names_init(policies):
    spec = f"{policies}:RaisesInInit"
    config = SimConfig(policy=spec, cache_bytes=2 * 10**9)    # its signature takes the options
    line = line_of(policies, 'raise KeyError("no such table")')
    with pytest.raises(PolicyError, match=re.escape(
            f"custom policy {spec!r}: RaisesInInit.__init__ raised KeyError: 'no such table' "
            f"({policies}:{line})")):
        config.make_manager()
    with pytest.raises(PolicyError, match=r"RaisesInInit\.__init__ raised KeyError"):
        simulate(ENTRIES, config)


def test_a_failure_in_inherited_code_names_the_method_and_says_where_it_was(policies):
    """can_allocate says yes, then the base class's allocate has no room."""
    spec = f"{policies}:CanAllocateLies"
    with pytest.raises(PolicyError) as error:
        simulate(ENTRIES, SimConfig(policy=spec, cache_bytes=2 * 10**9))
    message = str(error.value)
    assert message.startswith(f"custom policy {spec!r}: CanAllocateLies.allocate raised "
                              f"OutOfCapacityError: sequence "), message
    assert re.search(r"\(scheduler/managers/paged\.py:\d+, no line of the policy's own code "
                     r"in the traceback\)$", message), message


def test_a_free_that_keeps_memory_is_the_policys_leak_not_a_request_too_large(policies):
    spec = f"{policies}:NeverFrees"
    with pytest.raises(PolicyError) as error:
        simulate(ENTRIES, SimConfig(policy=spec, cache_bytes=2 * 10**9))
    message = str(error.value)
    assert message.startswith(f"custom policy {spec!r}: its stats() count "), message
    assert "NeverFrees.free kept the memory of sequences that ended or were preempted" in message
    assert "the run then failed with RequestTooLargeError: sequence " in message
    assert int(re.search(r"count ([\d,]+) live tokens", message)[1].replace(",", "")) > 0


def test_a_request_too_large_is_still_the_requests_under_a_correct_custom_policy(policies):
    """A correct custom policy's run fails as the built-in's does: the request is too large."""
    too_long = [TraceEntry(prompt_len=971, output_len=210, arrival_s=0.0)]   # 752 fit
    errors = []
    for policy in ("paged", f"{policies}:Mine"):
        with pytest.raises(RequestTooLargeError) as error:
            simulate(too_long, SimConfig(policy=policy, cache_bytes=10**8))
        errors.append(error.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert "1181 tokens can never fit" in str(errors[1])


def test_a_built_in_managers_error_passes_unchanged(monkeypatch):
    from vmemkv.scheduler.managers import PagedManager

    def broken(self, *args, **kwargs):
        raise RuntimeError("a bug of ours")
    monkeypatch.setattr(PagedManager, "allocate", broken)
    with pytest.raises(RuntimeError, match="^a bug of ours$"):
        simulate(ENTRIES, SimConfig(policy="paged", cache_bytes=2 * 10**9))


SWAP = SchedulerConfig(preemption="swap", watermark=0.0)


def test_a_swap_run_on_a_manager_without_swap_space_is_refused_before_it_runs(policies):
    spec = f"{policies}:NoName"                      # builds its base with no swap_bytes
    with pytest.raises(ConfigError, match=re.escape(
            f"preemption 'swap' with policy {spec!r}: its manager has no host swap space "
            f"(swap_bytes 0), so every preemption would silently recompute; swap_bytes is "
            f"1,000,000,000 here, and the class does not pass it on to its base")):
        simulate(ENTRIES, SimConfig(policy=spec, cache_bytes=10**9, swap_bytes=10**9,
                                    scheduler=SWAP))
    with pytest.raises(ConfigError, match="policy 'paged': .* give swap_bytes > 0"):
        SimConfig(cache_bytes=10**9, scheduler=SWAP).make_manager()


def test_the_docs_custom_policy_example_swaps_when_asked_to():
    """docs/simulation.md's example, run as written, then in a swap run: every preemption
    swapped, none recomputed (it dropped swap_bytes: 0 of 64 swapped)."""
    doc = (Path(__file__).parents[2] / "docs" / "simulation.md").read_text()
    section = doc[doc.index("## Your own policy"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    try:
        exec(compile(code, "docs/simulation.md", "exec"), {})     # noqa: S102 -- our own docs
        result = simulate(ENTRIES, SimConfig(policy="my_policies:CoarseBlocks", cache_bytes=10**9,
                                             swap_bytes=10**10, scheduler=SWAP))
    finally:
        sys.modules.pop("my_policies", None)
    assert result.policy == "coarse-blocks"
    assert result.num_preemptions == result.num_swap_preemptions > 0
    assert result.recomputed_tokens == 0


def test_a_subclass_of_a_built_in_is_charged_its_pool_before_it_is_built(policies, monkeypatch):
    """4 KiB pages over 1e13 bytes: 2.4 billion pages, 218 GiB of tables. The built-in vmem was
    refused before it was built; a subclass of it started building."""
    big = dict(page_bytes=4096, cache_bytes=10**13)
    spec = f"{policies}:NotBuilt"
    assert SimConfig(policy=spec, **big).pool_units == SimConfig(policy="vmem", **big).pool_units \
        == 10**13 // 4096
    assert SimConfig(policy=f"{policies}:NoName").pool_units == \
        SimConfig(policy="paged").pool_units > 0                # at the config's block_size
    assert SimConfig(policy=f"{policies}:Reserving").pool_units == 0
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: 64 << 30)
    with pytest.raises(SimulationTooLargeError, match=r"2,441,406,250 pages or blocks"):
        simulate(ENTRIES[:10], SimConfig(policy=spec, **big))


def test_results_are_labelled_with_the_spec_unless_the_class_names_itself(policies):
    short = ENTRIES[:10]
    assert simulate(short, SimConfig(policy=f"{policies}:NoName")).policy == \
        f"{policies}:NoName"                        # not "paged", the name it inherits
    assert simulate(short, SimConfig(policy=f"{policies}:Mine")).policy == "mine"
    assert simulate(short, SimConfig(policy="paged")).policy == "paged"


@pytest.mark.parametrize("entries,words", [
    ("trace.jsonl", "got str"),
    (pathlib.Path("trace.jsonl"), "got PosixPath"),
    ((e for e in ENTRIES), "got generator"),
    (ENTRIES[:3] + [None], "got list holding a NoneType at 3"),
    ([{"prompt_len": 10, "output_len": 5, "arrival_s": 0.0}], "got list holding a dict at 0"),
])
def test_entries_that_are_not_trace_entries_are_refused_naming_entries(entries, words):
    with pytest.raises(ConfigError, match=re.escape(
            f"simulate's entries must be a list or tuple of TraceEntry (traces.load_trace reads "
            f"a trace file), {words}")):
        simulate(entries, SimConfig())
    assert simulate(tuple(ENTRIES[:5]), SimConfig()).num_requests == 5


@pytest.mark.parametrize("field,value,words", [
    ("scheduler", {"watermark": 0.5}, "scheduler must be a SchedulerConfig, got {'watermark': 0.5}"),
    ("beam_width", True, "beam_width must be an int >= 0, got True"),
    ("policy", None, "policy must be one of reserve-max, reserve-oracle, paged, vmem or "
                     "module:Class, got None"),
    ("hybrid_parts", "no", "hybrid_parts must be True or False, got 'no'"),
])
def test_sim_config_fields_of_the_wrong_type_are_refused_by_name(field, value, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        SimConfig(**{field: value})
