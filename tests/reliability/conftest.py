"""Fixtures and helpers shared by the bad-input tests."""
import pytest

from vmemkv.runtime.models import build_model


@pytest.fixture(scope="module")
def model():
    """tiny-llama with seeded random weights (2 layers, 2 KV heads of 16 dims, fp32)."""
    return build_model("tiny-llama")


def assert_words(error, words):
    """Every word (a value, a limit, a field name) appears in the error's message."""
    for word in words:
        assert word in str(error), (word, str(error))


def mem_total() -> int:
    """This machine's memory in bytes (/proc/meminfo MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")
