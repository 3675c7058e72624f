"""A terminal's Ctrl-C under tensor parallelism: SIGINT to the whole foreground process group,
which holds the spawned ranks too (they fork from the rank server, in the terminal's group).
It killed rank 1 (KeyboardInterrupt in its plan wait), so the engine closed at the next step
and every request ended "aborted", though docs/usage.md says the Ctrl-C lands after the step and
``run_until_done()`` resumes with the tokens of an uninterrupted run. Ranks now ignore SIGINT:
rank 0 decides. The engine runs in a child in a session of its own, so the signal never reaches
pytest's process group; the child forks from this process's rank server (torch and vmemkv
already imported there) rather than starting a fresh interpreter, and starts a rank server of
its own, in its session, as any program does."""
from __future__ import annotations

import os
import signal
import time
import traceback

from vmemkv.runtime.distributed.group import rank_context
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

PROMPTS = [list(range(1, 40)), list(range(3, 30))]
NEW_TOKENS = 16
OPTIONS = dict(max_batch=4, max_context=128, self_check=False)
WAIT_S = 120.0   # bounds every wait on the child; none is expected to come near it


def _child(conn, environ: dict) -> None:
    """Rank 0 of a TP=2 engine, in a session of its own, with the test's environment
    ``environ`` (a forked child holds the server's, from when it started). After its third
    step under run_until_done it says "stepping" and sleeps until the test's SIGINT to its
    process group interrupts it (the ranks wait for the next plan meanwhile); then it says
    whether the run was interrupted, resumes, and sends the tokens. An error goes to the test
    as its traceback."""
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        with Engine(build_model("tiny-llama", seed=0), tensor_parallel_size=2, tp_timeout_s=30,
                    **OPTIONS) as engine:
            ids = [engine.add_request(p, params) for p in PROMPTS]
            steps = []

            def on_step(events):
                steps.append(len(events))
                if len(steps) == 3:
                    conn.send("stepping")
                    time.sleep(WAIT_S)   # ended by the SIGINT (KeyboardInterrupt), not its length
            try:
                engine.run_until_done(on_step=on_step)
                conn.send("not interrupted")
            except KeyboardInterrupt:
                conn.send("interrupted")
            engine.run_until_done()
            conn.send([engine.output(i).outputs[0].token_ids for i in ids])
    except BaseException:
        conn.send(traceback.format_exc())
        raise


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


def _receive(reader, what: str):
    assert reader.poll(WAIT_S), f"the child sent nothing in {WAIT_S:g} s, waiting for {what}"
    return reader.recv()


def test_a_ctrl_c_to_the_whole_process_group_lands_on_rank_0_and_the_run_resumes():
    model = build_model("tiny-llama", seed=0)
    with Engine(model, **OPTIONS) as alone:
        want = [o.outputs[0].token_ids for o in alone.generate(
            PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))]
    ctx = rank_context(preload=[type(model).__module__])   # the server a TP engine here uses
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(writer, dict(os.environ)), name="sigint-rank-0")
    child.start()
    writer.close()
    try:
        assert _receive(reader, "stepping") == "stepping"
        os.killpg(child.pid, signal.SIGINT)      # as a terminal's Ctrl-C: every process of it
        interrupted = _receive(reader, "whether the run was interrupted")
        tokens = _receive(reader, "the tokens")
        child.join(WAIT_S)
    finally:
        if child.exitcode is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.join()
    assert child.exitcode == 0, (interrupted, tokens)
    assert interrupted == "interrupted" and tokens == want
    deadline = time.monotonic() + 20.0          # the ranks exit with rank 0's engine
    while _group_members(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group_members(child.pid) == []
