"""How many examples each hypothesis state machine runs, by profile (``HYPOTHESIS_PROFILE``,
tests/conftest.py):

- ``ci`` (the default): half the count the machine names, at least 10, so the whole suite keeps
  CI's 5-minute budget on 2 cores (the state machines were 95 s of it at their full counts);
- ``thorough``: the count the machine names (``HYPOTHESIS_PROFILE=thorough pytest``);
- ``long``: at least 5,000 each, for local soaks.

Every machine's count goes through ``examples``; each still runs its full step count per example.
"""
import os

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
LONG_EXAMPLES = 5000


def examples(count: int) -> int:
    if PROFILE == "long":
        return max(count, LONG_EXAMPLES)
    if PROFILE == "thorough":
        return count
    return max(10, count // 2)
