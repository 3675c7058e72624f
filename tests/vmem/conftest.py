import pytest

from vmemkv import vmem
DRIVERS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DRIVERS)
def driver(request):
    """Each vmem semantics test runs on the host driver, and on CUDA where a GPU is present."""
    drv = vmem.open_driver(request.param)
    yield drv
    drv.close()


@pytest.fixture
def page_bytes(driver):
    """The smallest page the driver maps (4 KiB host, 2 MiB CUDA)."""
    return driver.granularity_bytes
