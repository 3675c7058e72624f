"""PagePool / VirtualRange from several threads (one lock per pool), and views that outlive
their range (the DLPack deleter keeps the memory readable; never a segfault)."""
import sys
import threading

import pytest

from vmemkv import vmem

from .forking import child_result, in_child

PAGE = 4096


def test_four_threads_contending_for_the_same_indices_keep_every_count_exact():
    """Each thread maps one shared page at indices the others use too, and allocates and
    releases pages: contention surfaces as typed errors only (never KeyError), and the counts
    end equal to what is really mapped."""
    driver = vmem.open_driver("host")
    pool = vmem.PagePool(driver, 16, PAGE)
    rng = vmem.VirtualRange(pool, 8 * PAGE)
    shared = pool.allocate(1)[0]
    unexpected, contended = [], [0]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)          # switch threads as often as CPython allows

    def work(thread: int) -> None:
        for i in range(1500):
            try:
                rng.map(i % 4, shared)
                rng.unmap(i % 4)
            except (vmem.AlreadyMappedError, vmem.NotMappedError):
                contended[0] += 1
            except Exception as error:   # noqa: BLE001 -- the failure this test looks for
                unexpected.append(repr(error))
            pages = pool.allocate(2)
            rng.map(4 + thread, pages[0])
            rng.unmap(4 + thread)
            pool.release(pages)
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert unexpected == []
    assert contended[0] > 0, "the threads never contended: the test proved nothing"
    pool.check_integrity()
    assert pool.mapping_count(shared) == sum(p == shared for p in rng.mapped_pages().values())
    for index in list(rng.mapped_pages()):
        rng.unmap(index)
    pool.release(shared)
    assert pool.free_pages == 16 and pool.mapped_pages == 0
    rng.close()
    pool.close()


def test_a_map_interrupted_after_its_driver_call_leaves_pool_and_range_agreeing():
    """A page's mapping count is read from its ranges' records (one write per map), so no
    interrupt can leave a page counted and not recorded, or recorded and not counted (a
    Ctrl-C between the two writes once left a count of -1 and a pool that would not close);
    ``undo_map`` then clears the mapping the driver made, and the index maps again."""
    from vmemkv.vmem.host import HostDriver

    class InterruptedAfterMapping(HostDriver):
        armed = True

        def map(self, address, handle, page_bytes):
            super().map(address, handle, page_bytes)
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt

    driver = InterruptedAfterMapping()
    with vmem.PagePool(driver, 4, PAGE) as pool, vmem.VirtualRange(pool, 4 * PAGE) as rng:
        page, other = pool.allocate(2)
        with pytest.raises(KeyboardInterrupt):
            rng.map(0, page)
        assert not rng.is_mapped(0) and pool.mapping_count(page) == 0 and pool.mapped_pages == 0
        pool.check_integrity()
        rng.undo_map(0)
        rng.map(0, other)
        rng.map(1, other)
        rng.tensor(0, PAGE).fill_(7)
        assert rng.tensor(PAGE, PAGE).eq(7).all() and pool.mapping_count(other) == 2
        rng.undo_unmap(0, other)                 # an unmap that never ran: nothing to redo
        assert pool.mapping_count(other) == 2
        rng.unmap(0)
        rng.unmap(1)
        pool.release([page, other])
        for bad in (4, -1, True):          # past the range: another range's page, once
            with pytest.raises(vmem.PageIndexError):
                rng.undo_map(bad)
            with pytest.raises(vmem.PageIndexError):
                rng.undo_unmap(bad, page)
    with pytest.raises(vmem.ClosedError):  # its address may be another range's by now
        rng.undo_map(0)


def _read_after_close() -> str:
    import gc
    import torch
    driver = vmem.open_driver("host")
    pool = vmem.PagePool(driver, 4, PAGE)
    rng = vmem.VirtualRange(pool, 4 * PAGE)
    pages = pool.allocate(2)
    rng.map(0, pages[0])
    rng.map(1, pages[1])
    view = rng.tensor(0, 2 * PAGE, torch.int32)
    view.copy_(torch.arange(2048, dtype=torch.int32))
    part = view[1000:1100]              # another view of the same storage
    rng.close()
    assert rng.live_views == 1 and pool.mapped_pages == 0
    pool.release(pages)                 # the pool may hand the pages out again ...
    other = vmem.VirtualRange(pool, PAGE)
    other.map(0, pool.allocate(1)[0])
    other.tensor(0, PAGE).fill_(0)      # ... and a new owner's writes never reach the view,
    part += 1                           # nor do the view's reach the new owner
    assert int(other.tensor(0, PAGE).sum()) == 0
    assert int(view[:1000].sum()) == sum(range(1000)) and int(part[0]) == 1001
    del view, part
    gc.collect()
    assert rng.live_views == 0          # the last view's deleter freed the reservation

    from vmemkv.runtime.hf.cache import VMemCache
    from tests.engine.conftest import reference_model
    model = reference_model("tiny-llama")
    cache = VMemCache.from_model_config(model.config, max_batch=2, max_context=64)
    model.generate(torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache, max_new_tokens=4,
                   do_sample=False)
    keys = cache.layers[0].keys
    before = keys.clone()
    cache.close()
    assert torch.equal(keys, before)    # read after close(): the bytes it held
    return "ok"


def test_views_read_after_close_see_their_bytes_and_never_segfault():
    """In a forked child: on main this read segfaults, which must fail this test, not the run."""
    pytest.importorskip("transformers")
    assert child_result(*in_child(_read_after_close)) == "'ok'"


def test_a_view_kept_after_close_reads_its_own_bytes_whatever_the_page_holds_next():
    """close() with a view alive remapped each page private over the memfd without copying,
    so a page the view had never written after close still showed the pool page: the next
    owner's bytes, then zeros once discarded. Now the view holds a copy taken at close()."""
    driver = vmem.open_driver("host")
    with vmem.PagePool(driver, 1, PAGE) as pool:
        (page,) = pool.allocate(1)
        old = vmem.VirtualRange(pool, 2 * PAGE)
        old.map(1, page)
        view = old.tensor(PAGE, PAGE)
        view.fill_(0xAA)                     # written through the shared page, before close
        old.close()
        assert old.live_views == 1 and pool.mapping_count(page) == 0
        pool.release(page)
        (again,) = pool.allocate(1)
        with vmem.VirtualRange(pool, PAGE) as new:
            new.map(0, again)                # the next owner of the same pool page
            new.tensor(0, PAGE).fill_(0x55)
            assert view.eq(0xAA).all()
            view[:8] = 1                     # and the view's writes stay its own
            assert new.tensor(0, PAGE).eq(0x55).all()
            new.unmap(0)
        pool.discard(again)                  # the page's memory given back
        assert view[8:].eq(0xAA).all() and view[:8].eq(1).all()
        del view
        assert old.live_views == 0
        pool.release(again)
