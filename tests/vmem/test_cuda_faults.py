"""On a GPU, touching a reserved but unmapped address faults, as on the host (GPU tests).

The CUDA counterpart of the host driver's SIGSEGV tests in test_host_resources.py: a kernel that
reads an unmapped page of a VMM reservation must stop with an illegal-address error, never read
zeros. The fault poisons the CUDA context, so each case runs in a child process.
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAULT_SCRIPT = textwrap.dedent("""
    import torch, vmem
    driver = vmem.open_driver("cuda")
    page = driver.granularity_bytes
    pool = vmem.PagePool(driver, 1, page)
    rng = vmem.VirtualRange(pool, 2 * page)
    rng.map(0, pool.allocate(1)[0])
    rng.tensor(0, page).fill_(1)
    print("mapped page read ok", int(rng.tensor(0, page).sum().item()), flush=True)
    {action}
    torch.cuda.synchronize()
    print("UNREACHABLE", flush=True)
""")


def run_fault_script(action: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    return subprocess.run([sys.executable, "-c", FAULT_SCRIPT.format(action=action)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("action", [
    pytest.param("print(rng.tensor(page, page).sum().item())", id="never-mapped"),
    pytest.param("rng.unmap(0); print(rng.tensor(0, page).sum().item())", id="unmapped-again"),
])
def test_reading_an_unmapped_page_faults_instead_of_reading_zeros(action):
    result = run_fault_script(action)
    assert "mapped page read ok" in result.stdout, result.stderr[-2000:]
    assert "UNREACHABLE" not in result.stdout and result.returncode != 0
    assert "illegal" in result.stderr.lower() or "fault" in result.stderr.lower(), result.stderr[-2000:]
