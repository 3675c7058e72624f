"""A beam group is admitted through the same manager contract as a sequence: a user's
manager whose ``allocate`` returns a prefix hit it could not have is refused with
ManagerContractError naming the class, and the group's placement is undone (it was
trusted here after the scheduler's own admission started checking it)."""
import pytest

from vmemkv.scheduler.managers.base import ManagerContractError
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .test_custom_manager_contract import PROMPT_TOKENS, claiming


@pytest.mark.parametrize("sharing", [True, False])
def test_an_impossible_hit_for_a_beam_group_is_refused_and_nothing_is_held(sharing):
    manager = claiming(lambda n, ids: n + 1)
    sched = Scheduler(manager, SchedulerConfig(enable_prefix_sharing=sharing))
    sched.add_request(Request(0, PROMPT_TOKENS, 4, tuple(range(100, 100 + PROMPT_TOKENS)),
                              beam_width=3))
    with pytest.raises(ManagerContractError, match=r"Claims\.allocate returned"):
        sched.schedule()
    assert all(s.state is SeqState.WAITING for s in sched.seqs.values())
    assert manager.stats().allocated_tokens == 0
    manager.check_integrity()
