"""CudaDriver against the real cuda-python bindings, on a machine without a GPU.

Every call CudaDriver makes goes through the installed ``cuda.bindings.driver``: its argument
parsing (types, counts, struct and enum names) runs for real, then the call stops where it would
load libcuda, which is not here. A thin stand-in answers for the driver library only, so the
lifecycle and the error paths (a failed cuMemSetAccess unmaps, a failed cuMemCreate releases what
it made) are checked call by call. With a GPU present the ``gpu`` tests do the real thing and
this module skips.
"""
import threading

import pytest
import torch

cu = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")

from vmemkv.vmem.cuda import CudaDriver  # noqa: E402
from vmemkv.vmem.errors import DriverCallError  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a GPU is present: the gpu tests make these calls for real")
GRANULARITY = 2 * 2**20
BASE_ADDRESS = 0x7F00_0000_0000
PRIMARY_CONTEXT = 0xC0FFEE


class LibcudaStandIn:
    """Passes each call to the real bindings; when they reach for libcuda (RuntimeError: the
    library is not on this machine) it records the call and answers as the driver would.
    ``fail`` maps a call name to the CUresult to answer on its ``fail_at``-th use (from 1).
    Each thread starts with no current context, as with the real driver."""

    def __init__(self, fail: dict | None = None, vmm_supported: int = 1):
        self.vmm_supported = vmm_supported
        self.calls: list[str] = []
        self.fail = fail or {}
        self.next_address, self.next_handle = BASE_ADDRESS, 1
        self.thread = threading.local()

    def __getattr__(self, name):
        real = getattr(cu, name)
        if not name.startswith("cu") or not callable(real):
            return real                          # types and enums come from the real module

        def call(*args):
            try:
                real(*args)
            except (TypeError, ValueError, OverflowError, AttributeError):
                raise                            # the bindings refused our arguments
            except RuntimeError:
                pass                             # parsed; stopped at loading libcuda
            else:
                pytest.fail(f"{name} reached a real CUDA driver; this test must not run there")
            self.calls.append(name)
            status, fail_at = self.fail.get(name, (None, 0))
            if status is not None and self.calls.count(name) == fail_at:
                return (status,)
            return (cu.CUresult.CUDA_SUCCESS, *self._answer(name, args))
        return call

    def _answer(self, name, args):
        if name == "cuDeviceGet":
            return (cu.CUdevice(args[0]),)
        if name == "cuDevicePrimaryCtxRetain":
            return (cu.CUcontext(PRIMARY_CONTEXT),)
        if name == "cuCtxGetCurrent":
            return (getattr(self.thread, "context", cu.CUcontext(0)),)
        if name == "cuCtxSetCurrent":
            self.thread.context = args[0]
        if name == "cuMemGetAllocationGranularity":
            return (GRANULARITY,)
        if name == "cuDeviceGetAttribute":
            return (self.vmm_supported,)
        if name == "cuMemAddressReserve":
            address, self.next_address = self.next_address, self.next_address + args[0]
            return (cu.CUdeviceptr(address),)
        if name == "cuMemCreate":
            self.next_handle += 1
            return (cu.CUmemGenericAllocationHandle(self.next_handle),)
        return ()


def bound_driver(stand_in: LibcudaStandIn) -> CudaDriver:
    driver = CudaDriver.__new__(CudaDriver)      # skip torch.cuda's checks, which need a GPU
    driver._bind(stand_in, 0)
    driver._open_device()
    return driver


def driver_calls(stand_in: LibcudaStandIn) -> list[str]:
    """The calls after opening, without the cheap per-call cuCtxGetCurrent."""
    return [c for c in stand_in.calls[7:] if c != "cuCtxGetCurrent"]


def test_descriptors_use_the_real_struct_and_enum_names():
    driver = bound_driver(LibcudaStandIn())
    assert driver._prop.type == cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert driver._prop.location.type == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    assert driver._access.flags == cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert driver.granularity_bytes == GRANULARITY and driver.device == "cuda:0"


def test_whole_lifecycle_passes_the_bindings_argument_checks():
    stand_in = LibcudaStandIn()
    driver = bound_driver(stand_in)
    address = driver.reserve(4 * GRANULARITY)
    assert address == BASE_ADDRESS and isinstance(address, int)
    handles = driver.create_pages(2, GRANULARITY)
    driver.map(address, handles[0], GRANULARITY)
    driver.map(address + 3 * GRANULARITY, handles[1], GRANULARITY)
    driver.unmap(address, GRANULARITY)
    driver.unmap(address + 3 * GRANULARITY, GRANULARITY)
    driver.release_pages(handles)
    driver.free_reservation(address, 4 * GRANULARITY)
    driver.close()
    assert stand_in.calls[:7] == ["cuInit", "cuDeviceGet", "cuDeviceGetAttribute",
                                  "cuDevicePrimaryCtxRetain",
                                  "cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemGetAllocationGranularity"]
    assert driver_calls(stand_in) == [
        "cuMemAddressReserve", "cuMemCreate", "cuMemCreate",
        "cuMemMap", "cuMemSetAccess", "cuMemMap", "cuMemSetAccess",
        "cuCtxSynchronize", "cuMemUnmap", "cuCtxSynchronize", "cuMemUnmap",   # queued kernels first
        "cuMemRelease", "cuMemRelease", "cuMemAddressFree", "cuDevicePrimaryCtxRelease"]


def test_another_thread_gets_the_primary_context_before_its_first_call():
    """The background mapper maps from its own thread, which starts with no current context."""
    stand_in = LibcudaStandIn()
    driver = bound_driver(stand_in)
    address = driver.reserve(2 * GRANULARITY)
    (handle,) = driver.create_pages(1, GRANULARITY)
    errors = []

    def mapper_thread():
        try:
            driver.map(address, handle, GRANULARITY)
            driver.unmap(address, GRANULARITY)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
    thread = threading.Thread(target=mapper_thread)
    thread.start()
    thread.join()
    assert not errors
    assert driver_calls(stand_in) == ["cuMemAddressReserve", "cuMemCreate", "cuCtxSetCurrent",
                                      "cuMemMap", "cuMemSetAccess", "cuCtxSynchronize", "cuMemUnmap"]
    assert int(stand_in.thread.context) == PRIMARY_CONTEXT     # this thread's is unchanged


def test_a_closed_driver_refuses_calls():
    from vmemkv.vmem.errors import ClosedError
    driver = bound_driver(LibcudaStandIn())
    driver.close()
    driver.close()                                   # twice is fine
    with pytest.raises(ClosedError, match="closed"):
        driver.reserve(GRANULARITY)


def test_a_failed_set_access_unmaps_again_and_names_the_error():
    stand_in = LibcudaStandIn(fail={"cuMemSetAccess": (cu.CUresult.CUDA_ERROR_INVALID_VALUE, 1)})
    driver = bound_driver(stand_in)
    address = driver.reserve(GRANULARITY)
    (handle,) = driver.create_pages(1, GRANULARITY)
    with pytest.raises(DriverCallError, match=r"cuMemSetAccess failed with CUDA_ERROR_INVALID_VALUE \(1\)"):
        driver.map(address, handle, GRANULARITY)
    assert driver_calls(stand_in)[-3:] == ["cuMemMap", "cuMemSetAccess", "cuMemUnmap"]


def test_running_out_part_way_through_create_pages_releases_what_was_made():
    stand_in = LibcudaStandIn(fail={"cuMemCreate": (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, 3)})
    driver = bound_driver(stand_in)
    with pytest.raises(DriverCallError, match="cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY"):
        driver.create_pages(5, GRANULARITY)
    assert driver_calls(stand_in) == ["cuMemCreate"] * 3 + ["cuMemRelease"] * 2


def test_page_sizes_off_the_granularity_are_refused_before_any_call():
    stand_in = LibcudaStandIn()
    driver = bound_driver(stand_in)
    from vmemkv.vmem.errors import AlignmentError
    for bad in (GRANULARITY // 2, 3 * GRANULARITY // 2, 0):
        with pytest.raises(AlignmentError, match=str(GRANULARITY)):
            driver.create_pages(1, bad)
        with pytest.raises(AlignmentError):
            driver.reserve(bad)
    assert driver_calls(stand_in) == []


def test_a_device_without_virtual_memory_management_is_refused_at_open():
    from vmemkv.vmem.errors import DriverUnavailableError
    stand_in = LibcudaStandIn(vmm_supported=0)
    with pytest.raises(DriverUnavailableError, match="VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0"):
        bound_driver(stand_in)
    assert "cuDevicePrimaryCtxRetain" not in stand_in.calls      # nothing retained to leak


def test_a_thread_with_another_context_current_gets_it_back_after_each_call():
    """torch's current device is the current context's: a call must not leave ours current."""
    stand_in = LibcudaStandIn()
    driver = bound_driver(stand_in)
    other = cu.CUcontext(0xBEEF)
    stand_in.thread.context = other
    address = driver.reserve(GRANULARITY)
    assert int(stand_in.thread.context) == 0xBEEF
    assert driver_calls(stand_in) == ["cuCtxSetCurrent", "cuMemAddressReserve", "cuCtxSetCurrent"]
    assert address == BASE_ADDRESS


def _mapped_pages(driver, num_pages):
    address = driver.reserve(num_pages * GRANULARITY)
    handles = driver.create_pages(num_pages, GRANULARITY)
    for i, handle in enumerate(handles):
        driver.map(address + i * GRANULARITY, handle, GRANULARITY)
    return address


def test_a_plan_synchronises_once_for_all_its_unmaps_then_each_unmap_again():
    stand_in = LibcudaStandIn()
    driver = bound_driver(stand_in)
    address = _mapped_pages(driver, 4)
    start = len(driver_calls(stand_in))
    driver.prepare_unmap(3)
    for i in range(3):
        driver.unmap(address + i * GRANULARITY, GRANULARITY)
    driver.unmap(address + 3 * GRANULARITY, GRANULARITY)   # past the credit: synchronises
    assert driver_calls(stand_in)[start:] == ["cuCtxSynchronize"] + ["cuMemUnmap"] * 3 + [
        "cuCtxSynchronize", "cuMemUnmap"]
    driver.prepare_unmap(0)                                # a plan without unmaps: no wait
    assert driver_calls(stand_in)[-1] == "cuMemUnmap"


def test_the_unmap_credit_is_per_thread_and_gone_in_a_rollback():
    stand_in = LibcudaStandIn()
    driver = bound_driver(stand_in)
    address = _mapped_pages(driver, 3)
    driver.prepare_unmap(3)
    start = len(driver_calls(stand_in))
    thread = threading.Thread(target=driver.unmap, args=(address, GRANULARITY))
    thread.start()
    thread.join()
    try:
        raise RuntimeError("a plan failed")
    except RuntimeError:                                   # undo runs while handling it
        driver.unmap(address + GRANULARITY, GRANULARITY)
    driver.unmap(address + 2 * GRANULARITY, GRANULARITY)   # the rollback spent the credit
    assert driver_calls(stand_in)[start:] == ["cuCtxSetCurrent", "cuCtxSynchronize", "cuMemUnmap"] + [
        "cuCtxSynchronize", "cuMemUnmap"] * 2


def test_auto_falls_back_to_host_on_a_gpu_without_virtual_memory_management(monkeypatch):
    from vmemkv.vmem import cuda as cuda_module, open_driver
    from vmemkv.vmem.errors import DriverUnavailableError

    def refuse(device_index=None):
        raise DriverUnavailableError("CUDA driver unavailable: device 0 does not support VMM")
    monkeypatch.setattr(cuda_module, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(cuda_module, "CudaDriver", refuse)
    driver = open_driver("auto")
    assert driver.name == "host"
    driver.close()
    with pytest.raises(DriverUnavailableError, match="does not support VMM"):
        open_driver("cuda")
