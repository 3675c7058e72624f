"""A forked child never writes its parent's memory through a view of a *held* page whose pool
was closed (vmem/vrange.py: a range closed under a view when the copies did not fit holds the
pool page; the pool's close() then closed its page file). At the fork such a page could not be
remapped copy-on-write (the file was gone): it stayed shared, and the child's write changed
what the parent's view reads. It is copied instead."""
import os

import pytest

from vmemkv import vmem

from .forking import child_result, in_child

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_a_child_writing_a_held_page_of_a_closed_pool_never_reaches_the_parent(monkeypatch):
    driver = vmem.open_driver("host")
    page = driver.granularity_bytes
    pool = vmem.PagePool(driver, 2, page)
    vrange = vmem.VirtualRange(pool, page)
    vrange.map(0, pool.allocate(1)[0])
    view = vrange.tensor(0, page)
    view.fill_(1)
    monkeypatch.setattr(driver, "available_bytes", lambda: 0)     # no memory for the copy
    vrange.close()
    assert pool.held_pages == 1                                    # the view holds the page
    pool.close()

    def child():
        view.fill_(9)
        return int(view.sum())
    assert child_result(*in_child(child)) == str(9 * page)
    assert int(view.sum()) == page          # the parent's view still reads its ones
    del view
