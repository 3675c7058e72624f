"""A forked child can never touch its parent's pages (vmem/forks.py): real fork(), both orders
of writing, through raw tensor views and through a live engine."""
import os

import pytest

from vmemkv import vmem

from .forking import child_result, in_child

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
PAGE = 4096


@pytest.fixture
def mapped():
    driver = vmem.open_driver("host")
    pool = vmem.PagePool(driver, 4, PAGE)
    rng = vmem.VirtualRange(pool, 4 * PAGE)
    page = pool.allocate(1)[0]
    rng.map(0, page)
    view = rng.tensor(0, PAGE)
    view.fill_(1)
    yield driver, pool, rng, view
    del view
    rng.close()
    pool.release(page)
    pool.close()


def test_a_child_writing_first_never_reaches_the_parents_page(mapped):
    driver, pool, rng, view = mapped

    def child():
        view.fill_(2)                       # a raw view: the child's own copy now
        return int(view.sum())
    assert child_result(*in_child(child)) == str(2 * PAGE)
    assert int(view.sum()) == PAGE          # the parent's page still holds ones
    view.fill_(3)
    assert int(view.sum()) == 3 * PAGE
    pool.check_integrity()


def test_a_child_writing_after_the_parent_never_reaches_the_parents_page(mapped):
    driver, pool, rng, view = mapped
    go_read, go_write = os.pipe()

    def child():
        seen = int(view[0])                 # the parent wrote 3 after the fork
        view.fill_(2)
        return seen
    pid, result = in_child(child, go=go_read)
    view.fill_(3)
    os.write(go_write, b"x")
    assert child_result(pid, result) == "3"
    assert int(view.sum()) == 3 * PAGE
    os.close(go_read), os.close(go_write)


def test_the_child_cannot_use_the_parents_driver_pool_or_range_but_can_open_its_own(mapped):
    driver, pool, rng, view = mapped

    def child():
        refused = []
        for attempt in (lambda: rng.map(1, pool.allocate(1)[0]), lambda: pool.allocate(1),
                        lambda: rng.unmap(0), lambda: rng.tensor(0, PAGE),
                        lambda: driver.reserve(PAGE), lambda: vmem.VirtualRange(pool, PAGE)):
            try:
                attempt()
            except vmem.ForkedError:
                refused.append(True)
        own = vmem.open_driver("host")
        with vmem.PagePool(own, 1, PAGE) as p, vmem.VirtualRange(p, PAGE) as r:
            r.map(0, p.allocate(1)[0])
            r.tensor(0, PAGE).fill_(7)
            r.unmap(0)
        rng.close()                         # frees the child's copy only
        pool.release(0) if not pool.is_free(0) else None
        pool.close()
        return (len(refused), rng.closed, pool.closed)
    assert child_result(*in_child(child)) == "(6, True, True)"
    assert int(view.sum()) == PAGE and rng.is_mapped(0) and not pool.closed
    pool.check_integrity()


def test_an_engine_forked_mid_generation_keeps_the_parents_tokens(tmp_path):
    """The child aborts the parent's request and runs others on its copy of the engine (their
    K/V written straight into the cache's views, over the parent's slot); the parent's tokens
    equal a run nobody forked, whichever writes first."""
    pytest.importorskip("transformers")
    from vmemkv.runtime.engine import Engine, SamplingParams
    from tests.engine.conftest import model
    options = dict(cache="vmem", page_bytes=PAGE, max_batch=2, max_context=64, self_check=False)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 42, 9, 3, 77, 120, 8]
    with Engine(model(), None, **options) as engine:      # one engine for the three runs
        solo = engine.generate([prompt], greedy)[0].outputs[0].token_ids
        for child_first in (True, False):
            rid = engine.add_request(prompt, greedy)
            for _ in range(6):
                engine.step()

            def child():
                engine.abort(rid)
                others = [[200 + i] * 12 for i in range(2)]
                outs = engine.generate(others, SamplingParams(max_new_tokens=2, ignore_eos=True))
                return [o.status for o in outs]
            go_read, go_write = os.pipe()
            pid, result = in_child(child, go=None if child_first else go_read)
            if not child_first:
                for _ in range(6):
                    engine.step()
                os.write(go_write, b"x")
            # the first ran on pages already mapped (the parent's slot); mapping more is refused
            assert child_result(pid, result).startswith("['finished'")
            engine.run_until_done()
            assert engine.output(rid).outputs[0].token_ids == solo, f"child_first={child_first}"
            os.close(go_read), os.close(go_write)


def memfd_fds() -> set:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(int(fd)) if "memfd:vmemkv-pages" in os.readlink(f"/proc/self/fd/{fd}") else None
        except OSError:
            pass
    return found


def test_a_fork_from_a_forked_child_never_closes_or_maps_the_childs_other_files(tmp_path):
    """The child closes its copies of the pool's memfds at the fork; a grandchild forked from it
    closed those fd numbers again, by then another file of the child's, and remapped the stale
    range over that file. Now a pool and a range are cut off once, in the first child."""
    before = memfd_fds()
    driver = vmem.open_driver("host")
    pool = vmem.PagePool(driver, 1, PAGE)
    (memfd,) = memfd_fds() - before
    rng = vmem.VirtualRange(pool, PAGE)
    rng.map(0, pool.allocate(1)[0])
    log = tmp_path / "child.log"

    def grandchild():
        with open("/proc/self/maps") as maps:
            at_range = [line for line in maps if int(line.split("-")[0], 16) == rng.address]
        try:
            inode = os.fstat(memfd).st_ino
        except OSError:                             # closed by the grandchild's fork
            inode = None
        return inode, str(log) in "".join(at_range)

    def child():
        fd = os.open(log, os.O_RDWR | os.O_CREAT)    # a file of the child's, at the memfd's number
        if fd != memfd:
            os.dup2(fd, memfd)
            os.close(fd)
        inode = os.fstat(memfd).st_ino
        seen = child_result(*in_child(grandchild))
        return seen == repr((inode, False)), seen, os.fstat(memfd).st_ino == inode
    assert child_result(*in_child(child)).startswith("(True,")
    rng.close()
    pool.release(0)
    pool.close()
