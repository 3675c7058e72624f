"""The last view of a range dying while an exception propagates (vmem/dlpack.py).

Unwinding a frame drops what it held (a ``for`` loop's tuple, say), so the last tensor over a
range can die with the user's exception still pending. The release that tells the range its
last view is gone used to be Python run by torch's DLPack deleter, a ctypes callback, in that
state: its first call failed, the user's exception came out as ``SystemError: error return
without exception set``, the range never learnt its view was gone (a closed range's memory
stayed held), and the interpreter could crash. The cases run in a fresh interpreter (one, to
pay torch's import once), each printing its line as it ends, so a crash fails the tests
instead of ending pytest.
"""
import json
import subprocess
import sys

import pytest

CASES = """
import ctypes, json, sys
from vmemkv import vmem
from vmemkv.vmem.dlpack import DLPACK_CPU, tensor_at

def drop_while_raising(make_view):
    try:
        for _ in ("first", make_view()):   # the tuple, and the view, die as this unwinds
            raise KeyError("the user's own error")
    except BaseException as error:
        return f"{type(error).__name__}: {error}"

def tensor_case():
    raw = (ctypes.c_char * 4096)()
    released = []
    caught = drop_while_raising(
        lambda: tensor_at(ctypes.addressof(raw), 4096, DLPACK_CPU,
                          on_release=lambda: released.append("released")))
    return {"caught": caught, "released": released}

def closed_range_case():
    driver = vmem.open_driver("host")
    page_bytes = driver.granularity_bytes
    pool = vmem.PagePool(driver, 4, page_bytes)
    out = {"page_bytes": page_bytes}
    def closed_ranges_view():
        rng = vmem.VirtualRange(pool, 2 * page_bytes)
        pages = pool.allocate(2)
        for index, page in enumerate(pages):
            rng.map(index, page)
        view = rng.tensor()
        view.fill_(7)
        rng.close()            # retired: the view keeps its bytes until it dies
        pool.release(pages)    # parked while the view may read them
        out["view_sum_after_close"] = int(view.sum())
        out["live_views_after_close"] = rng.live_views
        return view
    out["caught"] = [drop_while_raising(closed_ranges_view) for _ in range(3)]
    out["held_pages"], out["free_pages"] = pool.held_pages, pool.free_pages
    return out

for name, case in (("tensor", tensor_case), ("closed range", closed_range_case)):
    print(json.dumps({"case": name, **case()}), flush=True)
"""


@pytest.fixture(scope="module")
def cases() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", CASES],
                          capture_output=True, text=True, timeout=120)


def case_result(cases: subprocess.CompletedProcess, name: str) -> dict:
    """What case ``name`` printed; it must have ended with no exception reported."""
    assert "Exception ignored" not in cases.stderr, cases.stderr[-2000:]
    printed = [json.loads(line) for line in cases.stdout.splitlines()]
    by_case = {result.pop("case"): result for result in printed}
    assert name in by_case, f"exit {cases.returncode}: {cases.stderr[-2000:]}"
    return by_case[name]


def test_the_users_exception_arrives_intact_and_the_release_still_runs(cases):
    got = case_result(cases, "tensor")
    assert got == {"caught": "KeyError: \"the user's own error\"", "released": ["released"]}


def test_a_closed_ranges_view_dying_while_raising_frees_its_pages_without_a_crash(cases):
    got = case_result(cases, "closed range")
    assert cases.returncode == 0, cases.stderr[-2000:]            # the last case: a clean exit
    assert got["view_sum_after_close"] == 7 * 2 * got["page_bytes"]
    assert got["live_views_after_close"] == 1
    assert got["caught"] == ["KeyError: \"the user's own error\""] * 3
    assert (got["held_pages"], got["free_pages"]) == (0, 4)   # each retired range gave all back
