"""A terminal's Ctrl-C under tensor parallelism: SIGINT to the whole foreground process group,
which holds the spawned ranks too (they fork from the rank server, in the terminal's group).
It killed rank 1 (KeyboardInterrupt in its plan wait), so the engine closed at the next step
and every request ended "aborted", though docs/usage.md says the Ctrl-C lands after the step and
``run_until_done()`` resumes with the tokens of an uninterrupted run. Ranks now ignore SIGINT:
rank 0 decides. The engine runs in a child in a session of its own, so the signal never reaches
pytest's process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

PROMPTS = [list(range(1, 40)), list(range(3, 30))]
NEW_TOKENS = 16
OPTIONS = dict(max_batch=4, max_context=128, self_check=False)

# The child: after its third step under run_until_done it says "stepping" and the test sends
# SIGINT to its process group; each later step is paced (50 ms) so the signal lands mid-run.
CHILD = f"""
import json, time
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model
params = SamplingParams(max_new_tokens={NEW_TOKENS}, ignore_eos=True)
with Engine(build_model("tiny-llama", seed=0), tensor_parallel_size=2, tp_timeout_s=30,
            **{OPTIONS!r}) as engine:
    ids = [engine.add_request(p, params) for p in {PROMPTS!r}]
    steps = []
    def on_step(events):
        steps.append(len(events))
        if len(steps) == 3:
            print("stepping", flush=True)
        if len(steps) >= 3:
            time.sleep(0.05)
    try:
        engine.run_until_done(on_step=on_step)
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    engine.run_until_done()
    print(json.dumps([engine.output(i).outputs[0].token_ids for i in ids]), flush=True)
"""


def _group_members(pgid: int) -> list:
    """Process ids in process group ``pgid`` (zombies included)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def test_a_ctrl_c_to_the_whole_process_group_lands_on_rank_0_and_the_run_resumes():
    with Engine(build_model("tiny-llama", seed=0), **OPTIONS) as alone:
        want = [o.outputs[0].token_ids for o in alone.generate(
            PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))]
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "stepping"
        os.killpg(child.pid, signal.SIGINT)      # as a terminal's Ctrl-C: every process of it
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
    lines = out.splitlines()
    assert child.returncode == 0, err[-3000:]
    assert lines[0] == "interrupted" and json.loads(lines[1]) == want
    deadline = time.monotonic() + 20.0          # the ranks exit with rank 0's engine
    while _group_members(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group_members(child.pid) == []
