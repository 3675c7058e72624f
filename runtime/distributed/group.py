"""The tensor-parallel process group: start ranks, move plans, sum activations, all with bounded
waits, and tear everything down.

Transport is torch.distributed: the default group is ``gloo`` on CPU tensors and carries plans,
the start agreement and (on the CPU) the activation sums; on CUDA the activation sums go over a
second, ``nccl`` group (``open_activation_group``). Every collective a step makes waits at most
``step_timeout_s``. Over gloo a rank that died closes its sockets, so its peers fail at once
rather than at the timeout; over NCCL a dead or hung peer is seen at the timeout (blocking
wait), and the next plan broadcast (gloo) sees a dead one at once. A follower waiting for the
next plan waits as long as rank 0 is alive (an idle engine is not a fault).
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import signal
import socket
import sys
import threading
import time
from multiprocessing import forkserver
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from vmemkv.runtime.engine.errors import TensorParallelConfigError, TensorParallelError

# the group's own timeout once every rank started (lift_group_timeout): it bounds a follower's
# wait for the next plan, so a century (gloo's nanosecond clock takes it; timedelta.max not).
# It was 7 days: a follower of an engine idle that long exited, and the next request closed it.
IDLE = datetime.timedelta(days=365 * 100)
INLINE_BYTES = 64 * 1024            # a plan pickle up to this size crosses in one broadcast
RANK_MODULE = "vmemkv.runtime.distributed.worker"   # a spawned rank's code (its imports)
START_METHOD_ENV = "VMEMKV_TP_START_METHOD"         # how spawned ranks start (rank_context)
START_METHODS = ("forkserver", "spawn")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """One process's side of the group: ``rank`` of ``world``, collectives bounded by
    ``step_timeout_s`` (TensorParallelError naming the collective when one fails or times out)."""

    def __init__(self, rank: int, world: int, step_timeout_s: float) -> None:
        self.rank, self.world, self.step_timeout_s = rank, world, step_timeout_s
        self.activation_group = None   # the NCCL group on CUDA (open_activation_group); None:
                                       # the default gloo group carries the activations too
        self.comm_s = 0.0      # seconds spent in collectives (plans + activation sums)
        self.collectives = 0   # collectives this process has waited on

    def _wait(self, work, what: str, timeout_s: Optional[float]) -> None:
        start = time.perf_counter()
        self.collectives += 1
        try:
            if timeout_s is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as error:
            raise TensorParallelError(
                f"rank {self.rank}: {what} {_how_it_ended(time.perf_counter() - start, timeout_s)}"
                f": {type(error).__name__}: {str(error)[:200]}") from error
        finally:
            self.comm_s += time.perf_counter() - start

    def all_reduce_(self, tensor: torch.Tensor, what: str = "activation all_reduce") -> None:
        """Sum ``tensor`` over ranks in place (over NCCL when it is on a GPU)."""
        self._wait(dist.all_reduce(tensor, group=self.activation_group, async_op=True), what,
                   self.step_timeout_s)

    def min_over_ranks(self, value: int, what: str, timeout_s: Optional[float] = None) -> int:
        """The smallest ``value`` any rank passed (``timeout_s``: default ``step_timeout_s``)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True), what,
                   self.step_timeout_s if timeout_s is None else timeout_s)
        return int(t.item())

    def ranks_flagging(self, flag: bool, what: str) -> List[int]:
        """The ranks that passed ``flag`` True, on every rank (one all_reduce of world int32s)."""
        t = torch.zeros(self.world, dtype=torch.int32)
        t[self.rank] = int(bool(flag))
        self._wait(dist.all_reduce(t, async_op=True), what, self.step_timeout_s)
        return [r for r, f in enumerate(t.tolist()) if f]

    def broadcast(self, obj: Any = None, *, idle: bool = False) -> Any:
        """Rank 0 sends ``obj`` (pickled); every other rank returns it. ``idle``: a follower
        waiting for work, which may wait as long as rank 0 lives. One collective when the
        pickle fits ``INLINE_BYTES`` (a decode plan of hundreds of sequences does), two otherwise:
        a frame of [8-byte length | the first INLINE_BYTES], then the rest."""
        frame = torch.zeros(INLINE_BYTES + 8, dtype=torch.uint8)
        data = pickle.dumps(obj) if self.rank == 0 else b""
        if self.rank == 0:
            head = len(data).to_bytes(8, "little") + data[:INLINE_BYTES]
            frame[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._wait(dist.broadcast(frame, 0, async_op=True), "plan broadcast",
                   None if idle else self.step_timeout_s)
        size = int.from_bytes(frame[:8].numpy().tobytes(), "little")
        rest = None
        if size > INLINE_BYTES:
            rest = (torch.frombuffer(bytearray(data[INLINE_BYTES:]), dtype=torch.uint8)
                    if self.rank == 0 else torch.empty(size - INLINE_BYTES, dtype=torch.uint8))
            self._wait(dist.broadcast(rest, 0, async_op=True), "plan broadcast (rest)",
                       self.step_timeout_s)
        if self.rank == 0:
            return obj
        body = frame[8:8 + min(size, INLINE_BYTES)].numpy().tobytes()
        return pickle.loads(body + (rest.numpy().tobytes() if rest is not None else b""))


    def gather(self, obj: Any, what: str = "state gather") -> List[Any]:
        """Every rank's ``obj`` (pickled, at most ``INLINE_BYTES``), in rank order, on every
        rank: one all_gather of fixed frames. A larger ``obj`` is a bug (ValueError)."""
        data = pickle.dumps(obj)
        if len(data) > INLINE_BYTES:
            raise ValueError(f"rank {self.rank}: {what} of {len(data)} bytes exceeds the "
                             f"{INLINE_BYTES}-byte frame")
        head = len(data).to_bytes(8, "little") + data
        frame = torch.zeros(INLINE_BYTES + 8, dtype=torch.uint8)
        frame[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        frames = [torch.empty_like(frame) for _ in range(self.world)]
        self._wait(dist.all_gather(frames, frame, async_op=True), what, self.step_timeout_s)
        out = []
        for f in frames:
            size = int.from_bytes(f[:8].numpy().tobytes(), "little")
            out.append(pickle.loads(f[8:8 + size].numpy().tobytes()))
        return out

def _how_it_ended(elapsed_s: float, timeout_s: Optional[float]) -> str:
    """A failed wait in words: timed out (``elapsed_s`` reached ``timeout_s``, less 5% for the
    backend's own clock) or failed before it, which is a rank that died or raised, not a hang."""
    limit_s = IDLE.total_seconds() if timeout_s is None else timeout_s
    if elapsed_s >= 0.95 * limit_s:
        return f"waited past {limit_s:g} s (a rank died or hung)"
    return f"failed after {elapsed_s:.2f} s, before its {limit_s:g} s timeout (a rank died or failed)"


# while init_group's group is open: (sys.excepthook before, the one init_process_group put
_joined: Optional[tuple] = None   # instead, prefixing "[rank0]: ", which destroy never unwraps)


def _timeout_setter() -> Optional[Callable]:
    """torch's private setter of the group's timeout (torch 2.13's); None in a torch without."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:
        return None
    return _set_pg_timeout


def init_group(rank: int, world: int, *, start_timeout_s: float,
               init_method: Optional[str] = None, store=None) -> None:
    """Join the default gloo group (``env://`` when neither is given, as torchrun sets it up),
    its timeout ``start_timeout_s`` until ``lift_group_timeout`` (IDLE, Engine() hung on a rank
    stopped in the rendezvous; IDLE still in a torch with no setter to lift it by)."""
    global _joined
    kw = {"store": store} if store is not None else {"init_method": init_method or "env://"}
    before = sys.excepthook
    timeout = datetime.timedelta(seconds=start_timeout_s) if _timeout_setter() else IDLE
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout, **kw)
    _joined = (before, sys.excepthook)


def lift_group_timeout() -> None:
    """Once every rank started: the group's own timeout becomes IDLE. It bounds only a
    follower's wait for the next plan; every other collective passes its own timeout."""
    if _timeout_setter() is not None:
        _timeout_setter()(IDLE)


def joined_by_engine() -> bool:
    """True while this process is in a group ``init_group`` opened (a TP engine's, a rank's)."""
    return _joined is not None and dist.is_initialized()


def open_activation_group(group: RankGroup, backend: str, device: torch.device) -> None:
    """On CUDA (``backend`` "nccl"), every rank's NCCL group for the activation sums, created
    eagerly on ``device`` with ``step_timeout_s`` as its timeout; a collective over every rank of
    the default group. Unless the user set them: ``TORCH_NCCL_BLOCKING_WAIT=1`` makes a wait
    block and raise at that timeout, which ``_wait`` turns into TensorParallelError, and
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` has NCCL's watchdog abort the communicator on a timeout
    (so the hung collective and the group's teardown return) instead of its default, tearing
    the whole process down. Nothing to do for gloo."""
    if backend != "nccl":
        return
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    group.activation_group = dist.new_group(
        backend="nccl", timeout=datetime.timedelta(seconds=group.step_timeout_s), device_id=device)


def leave_group() -> None:
    """Leave the default group; put back the ``sys.excepthook`` ``init_group`` found, unless it
    was replaced since (each TP engine left one more "[rank0]: " on every later traceback)."""
    global _joined
    if dist.is_initialized():
        dist.destroy_process_group()
    if _joined is not None and sys.excepthook is _joined[1]:
        sys.excepthook = _joined[0]
    _joined = None


def watch_parent() -> None:
    """In a rank rank 0 started: exit at once when rank 0's process is gone, however it ended
    (never an orphan). multiprocessing holds a pipe from rank 0 open for each child; it reads
    end-of-file when rank 0 exits (``parent_process().join()`` returns)."""
    parent = multiprocessing.parent_process()

    def loop() -> None:
        parent.join()
        os._exit(3)
    threading.Thread(target=loop, name="vmemkv-tp-parent-watch", daemon=True).start()


@contextlib.contextmanager
def rank_0_takes_interrupts():
    """In a follower rank (on the main thread; elsewhere nothing changes): SIGINT ignored for the
    block. A terminal's Ctrl-C reaches every process in its foreground group, ranks included;
    rank 0 alone decides what it means (docs/usage.md: it lands after the step under way), and
    a follower ends when rank 0 closes or exits. Before, it killed the follower mid-step and
    the engine closed with every request aborted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def rank_context(preload: Sequence[str] = ()):
    """The multiprocessing context ranks start in: ``forkserver`` (``START_METHOD_ENV`` set to
    ``spawn`` chooses a fresh interpreter per rank instead). The server, started once per
    process by the first engine that spawns ranks and left running until this process exits,
    imports torch, vmemkv's rank code and ``preload`` (the model's module) once; each rank
    forks from it, so a rank starts without a fresh interpreter's imports (about 3 s each
    under ``spawn``). Forking from that server is CUDA-safe: it never touches CUDA. Preloading
    is an optimization only: once the server runs (or when a module fails to import there) a
    rank imports what it needs itself. TensorParallelConfigError for another method."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in START_METHODS:
        raise TensorParallelConfigError(f"{START_METHOD_ENV}={method!r}: ranks start with one of "
                                        f"{', '.join(START_METHODS)}")
    ctx = torch.multiprocessing.get_context(method)
    if method == "forkserver":
        wanted = [RANK_MODULE, *preload]
        server = getattr(forkserver, "_forkserver", None)     # CPython's one per process
        current = [m for m in getattr(server, "_preload_modules", [])
                   if m != "__main__"]   # a rank imports the main module itself, as under spawn
        ctx.set_forkserver_preload(current + [m for m in wanted if m not in current])
    return ctx


def _send_payloads(writers: list, payload: Any) -> None:
    """Send each rank its payload and rank 0's standard output and error as they are now (a
    forked rank holds the server's, from when it started), one rank after another, on a thread
    of its own: a rank that never reads (stuck importing the main module) leaves rank 0 to time
    out in ``wait_for`` instead of blocking here; a rank that died first is also ``wait_for``'s
    to report."""
    for writer in writers:
        try:
            writer.send((payload, _std_streams()))
        except OSError:
            pass
        finally:
            writer.close()


def _std_streams() -> dict:
    """{1: fd, 2: fd} of this process's stdout and stderr, as descriptors a rank receives
    (multiprocessing's resource sharer); a closed one is left out."""
    streams = {}
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            continue
        streams[fd] = multiprocessing.reduction.DupFd(fd)
    return streams


def take_std_streams(streams: dict) -> None:
    """In a rank: write stdout and stderr where rank 0's pointed when it sent ``streams``."""
    for fd, shared in streams.items():
        received = shared.detach()
        os.dup2(received, fd)
        os.close(received)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:    # a real-time signal has no name
        return f"signal {number}"


class SpawnedRanks:
    """Ranks 1..world-1 as child processes of rank 0 on this machine (``rank_context``), their
    start and their end. ``target(rank, world, host, port, environ, payload_reader)`` runs in
    each: ``environ`` is rank 0's environment now (a forked rank inherits the server's, from
    when it started: the target applies this one first); ``payload_reader.recv()`` gives the
    payload and rank 0's stdout and stderr (``take_std_streams``). They are sent once the rank
    runs, not with the start: a model's CPU tensors cross as shared-memory file descriptors,
    and a forkserver start carries at most 256 of them (a real model has hundreds); sent after,
    they go through multiprocessing's resource sharer."""

    def __init__(self, world: int, target: Callable, payload: Any, start_timeout_s: float,
                 preload: Sequence[str] = ()) -> None:
        ctx = rank_context(preload)
        self.world, self.port = world, free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, world, is_master=True,
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=start_timeout_s))
        environ = dict(os.environ)
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]    # (reader, writer) a rank
        self.procs: List = [ctx.Process(target=target, name=f"vmemkv-tp-rank{r}", daemon=True,
                                        args=(r, world, "127.0.0.1", self.port, environ, reader))
                            for r, (reader, _) in zip(range(1, world), pipes)]
        for p in self.procs:
            p.start()
        for reader, _ in pipes:
            reader.close()                       # the rank's end: it holds its own copy
        threading.Thread(target=_send_payloads, args=([w for _, w in pipes], payload),
                         name="vmemkv-tp-payloads", daemon=True).start()

    def wait_for(self, key: str, timeout_s: float) -> None:
        """Block until every spawned rank set ``key`` in the store; TensorParallelError naming the
        rank when one died first, reported an error, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(1, self.world))
        while pending:
            for r in sorted(pending):
                if self.store.check([f"error{r}"]):
                    raise TensorParallelError(f"rank {r} failed: {self.store.get(f'error{r}').decode()}")
                if self.store.check([f"{key}{r}"]):
                    pending.discard(r)
                elif not self.procs[r - 1].is_alive():
                    raise TensorParallelError(
                        f"rank {r} exited with code {self.procs[r - 1].exitcode} before '{key}' "
                        f"(its output says why; a script that starts a tensor-parallel engine "
                        f"must guard it with `if __name__ == '__main__':`, as each rank "
                        f"re-imports the main module)")
            if pending and time.monotonic() > deadline:
                raise TensorParallelError(f"rank(s) {sorted(pending)} did not reach '{key}' within "
                                          f"{timeout_s:g} s")
            time.sleep(0.02)

    def error_of(self, rank: int) -> Optional[str]:
        try:
            if self.store.check([f"error{rank}"]):
                return self.store.get(f"error{rank}").decode()
        except Exception:   # the store may be gone with rank 0's group
            return None
        return None

    def typed_error_of(self, rank: int) -> Optional[BaseException]:
        """The error ``rank`` reported for rank 0 to raise as it is (a CacheTooLargeError: the
        user's to fix, not a fault of the group), or None."""
        try:
            if self.store.check([f"typed_error{rank}"]):
                return pickle.loads(self.store.get(f"typed_error{rank}"))
        except Exception:   # the store may be gone with rank 0's group
            return None
        return None

    def fate_of(self, rank: int) -> Optional[str]:
        """How ``rank``'s process ended (its exit code, or the signal that killed it), or that
        it is stopped (SIGSTOP, a debugger: /proc state T or t); None while it runs."""
        proc = self.procs[rank - 1]
        if proc.is_alive():       # (else it has exited: is_alive reaped it, exitcode is set)
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return None
            return f"rank {rank} (pid {proc.pid}) is stopped" if state in ("T", "t") else None
        if proc.exitcode is None:  # never started
            return None
        if proc.exitcode < 0:
            return f"rank {rank} (pid {proc.pid}) was killed by {_signal_name(-proc.exitcode)}"
        return f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"

    def stop(self, grace_s: float = 5.0) -> None:
        """Join every rank; terminate, then kill, any still alive after ``grace_s``."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
