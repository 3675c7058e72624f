"""Cost and metrics figures at their edges: what a step's map count leaves out, and how many
latency samples a SampleLog keeps."""
from vmemkv.scheduler.cost import count_map_ops
from vmemkv.scheduler.managers.base import MapExtent
from vmemkv.scheduler.metrics import SampleLog


def test_growing_a_group_alone_maps_no_new_page_group():
    # byte-backed groups grow by MapExtent first_page > 0: no group is newly mapped
    grow = [MapExtent(0, 3, "full", (4, 5), first_page=1), MapExtent(1, 0, "full", (6, 7), first_page=2)]
    assert count_map_ops(grow) == 0
    assert count_map_ops(grow + [MapExtent(1, 1, "full", (8, 9))]) == 1


def test_a_sample_log_keeps_every_sample_until_twice_keep_then_the_latest_keep():
    log = SampleLog(keep=4)
    for i in range(7):
        log.append(float(i))
    assert log.since() == [float(i) for i in range(7)] and log.dropped == 0
    log.append(7.0)                       # 8 = 2 * keep: trimmed to the latest 4
    assert log.since() == [4.0, 5.0, 6.0, 7.0] and log.dropped == 4 and log.end == 8
