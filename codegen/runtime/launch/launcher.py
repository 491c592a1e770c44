"""Start ranks: a local launcher for CPU development and tests, and the torchrun command otherwise.

``launch(fn, world)`` starts ``world``'s processes on this machine (forks of a forkserver that has
torch and Xirang imported, see _start_context), each one rank of a fresh
``torch.distributed`` world (gloo by default), runs ``fn(rank, world_size, *args)`` in each and
returns their results in rank order. Failure is the interesting part: a rank that raises, dies
(``os._exit``, a signal) or hangs must not leave the parent, or the other ranks, waiting forever.
So each rank reports through its own pipe, the parent waits on all pipes, a pipe that closes
without a result means that rank died, and on the first failure every other rank is terminated.
The process-group timeout (``DEFAULT_PG_TIMEOUT_S`` unless given) bounds how long a collective
inside a rank waits for a peer that is gone or never calls it, so the survivors fail too instead
of hanging until they are killed. A limit on the whole run is the caller's choice (``timeout_s``);
there is none by default: a long run is not a fault.

A rank that raises a ``XirangError`` is reported by its explanation alone (the traceback with
``XIRANG_DEBUG=1``); any other exception is a bug and keeps its traceback. Ranks that raised the
same text are listed once.

A rank can also stop without dying (SIGSTOP, a debugger, a frozen host): each rank's heartbeat
thread writes to its pipe several times per ``heartbeat_s``, and a rank silent for longer is named
as frozen and the launch fails then, not at the deadline. And ranks never outlive the launch: the
parent turns SIGTERM (what ``timeout``, CI and Slurm send) into an exit that stops every rank, and
each rank asks the kernel to kill it when its parent (the forkserver, which exits with the
launching process) dies, so even a SIGKILLed launcher leaves no orphan training on.

Real runs, on GPUs or several nodes, go through torch's own launcher; ``launch_command`` spells
its command line and ``ensure_distributed`` joins the world it sets up, or says how to start one.
"""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xirang.ir.errors import XirangError, tracebacks_wanted
from xirang.ir.renamed import renamed_keywords
from xirang.ir.world import World, parse_world

HEARTBEAT_S = 10.0  # default: a rank silent this long is reported as frozen
# default process-group timeout: a collective left waiting this long raises inside its rank. torch's
# own default is 30 min (gloo); 5 min is far above any one wait of a healthy step on CPU ranks.
DEFAULT_PG_TIMEOUT_S = 300.0
_BEATS_PER_INTERVAL = 5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# After the first failure, how long to keep listening for the others before reporting: a peer
# that dies usually makes its neighbours fail in a collective within milliseconds, and listing
# them together (root cause first) beats a report that shows only whichever pipe was read first.
_GRACE_S = 0.5


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent exits (elsewhere: nothing to ask)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request: nobody would kill us
        os._exit(1)


class _Reporter:
    """This rank's pipe to the parent, shared by the heartbeat thread and the final report."""

    def __init__(self, conn, heartbeat_s: float):
        self.conn, self.lock, self.done = conn, threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._beat, args=(heartbeat_s / _BEATS_PER_INTERVAL,),
                                       name="xirang-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self, period: float) -> None:
        while not self.done.wait(period):
            self.send(("beat",))

    def send(self, message) -> None:
        with self.lock:
            if not self.conn.closed:
                self.conn.send_bytes(pickle.dumps(message))

    def finish(self, message) -> None:
        self.done.set()
        with self.lock:
            self.conn.send_bytes(pickle.dumps(message))
            self.conn.close()


def _rank_main(rank, world, port, backend, pg_timeout_s, threads, environment, payload, conn, heartbeat_s=HEARTBEAT_S):
    """Body of one spawned rank: join the world, run fn, send back ("ok", bytes) or an error.

    ``payload`` is ``pickle.dumps((fn, args))`` made by the parent: unpickling it here, inside the
    try, makes an error (or a hang) while rebuilding the arguments this rank's reported failure or
    the launch deadline's business, instead of blocking the parent inside ``Process.start``."""
    _die_with_parent(os.getppid())
    reporter = _Reporter(conn, heartbeat_s)
    os.environ.clear()  # the forkserver's environment is from its start: use the parent's of now
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # Ranks share this machine's cores; torch's default (all cores each) oversubscribes them.
    torch.set_num_threads(threads)
    initialised = False
    try:
        fn, args = pickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        initialised = True
        # Pickle here, not in a queue's feeder thread, so an unpicklable result is this rank's
        # reported error rather than a silently missing result.
        message = ("ok", pickle.dumps(fn(rank, world, *args)))
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes to the parent
        # time.time() is comparable across the local ranks: the parent lists the earliest first.
        message = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), time.time(),
                   isinstance(exc, XirangError))
    # Report before tearing down: destroying the group resets the peers' connections, and their
    # errors must not reach the parent before this rank's own.
    reporter.finish(message)
    if initialised:
        dist.destroy_process_group()


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "closed its result pipe without a result and is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code} (exit code {code})"
    return f"exited with code {code} before returning a result (see its stderr)"


def rank_count(world, where: str) -> int:
    """The ranks ``world`` names (a positive int, "N", "NxM" or a World), else a XirangError at ``where``."""
    if isinstance(world, World):
        return world.size
    if isinstance(world, int) and not isinstance(world, bool) and world >= 1:
        return int(world)  # the common case; the CLI's WorldArg ("2x4") is an int of its ranks
    try:
        if isinstance(world, bool) or not isinstance(world, (int, str)):
            raise ValueError(f"a {type(world).__name__}")
        return parse_world(world, "cpu").size  # the count alone: which preset does not matter
    except ValueError as error:
        raise XirangError(f"world={world!r} is not a number of ranks ({error})", where=where,
                          hint="pass the number of ranks the mesh needs (pp * dp * cp * tp), 'NxM' or a World") \
            from None


def _fn_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@renamed_keywords(nprocs="world=")
def launch(fn: Callable, world: Union[int, str, World], args: Sequence = (), *, backend: str = "gloo",
           timeout_s: Optional[float] = None, pg_timeout_s: Optional[float] = None,
           heartbeat_s: float = HEARTBEAT_S) -> list:
    """Run ``fn(rank, size, *args)`` on ``world``'s ranks spawned on this machine; results in rank order.

    ``world`` is spelt as ``xirang.compile``'s: a rank count, "NxM" (N nodes of M devices: N * M
    ranks here) or a World (its size); ``size`` is the rank count.

    ``fn``, ``args`` and each result must be picklable (``fn`` defined at module top level).
    ``timeout_s``, when given, bounds the whole run, start-up included (default: no limit);
    ``pg_timeout_s`` (default ``timeout_s`` if given, else ``DEFAULT_PG_TIMEOUT_S``) is the
    process-group timeout after which a collective waiting on a missing peer raises inside its
    rank; a rank whose heartbeat is silent for ``heartbeat_s`` is reported as frozen. Any failing
    rank raises ``XirangError`` naming it.
    """
    where = f"launch({_fn_name(fn)}, world={world!r}, backend={backend!r})"
    nprocs = rank_count(world, where)
    for name, value in (("timeout_s", timeout_s), ("pg_timeout_s", pg_timeout_s), ("heartbeat_s", heartbeat_s)):
        if value is None and name != "heartbeat_s":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise XirangError(f"{name} must be a positive number of seconds, got {value!r}", where=where,
                              hint=f"pass {name}= greater than 0")
    try:
        payload = pickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise XirangError(f"fn or args cannot be sent to a spawned rank: {exc}", where=where,
                          hint="define fn at the top level of an importable module (no lambda or "
                               "nested function) and pass only picklable args") from exc
    if pg_timeout_s is None:
        pg_timeout_s = DEFAULT_PG_TIMEOUT_S if timeout_s is None else timeout_s
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    ctx, port = _start_context(), free_port()
    environment = dict(os.environ)

    procs, readers, failures = [], {}, None
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    try:
        with _sigterm_stops_ranks():
            for rank in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_rank_main, name=f"xirang-rank-{rank}",
                                   args=(rank, nprocs, port, backend, pg_timeout_s, threads, environment, payload,
                                         writer, heartbeat_s))
                proc.start()
                writer.close()  # only the child holds the writer, so its death reads as EOF here
                procs.append(proc)
                readers[reader] = rank
            results, failures = _collect(procs, readers, deadline, heartbeat_s)
    finally:
        # On success the ranks are only tearing down their process groups: let them finish.
        _stop_all(procs, wait_s=2.0 if failures == [] else 0.0)
        for reader in readers:
            reader.close()
    if failures:
        raise _launch_error(failures, nprocs, timeout_s, pg_timeout_s, where)
    return [results[rank] for rank in range(nprocs)]


# Modules every rank imports. A forkserver imports them once; each rank is then a fork of it, so
# starting 8 ranks costs milliseconds instead of 8 fresh interpreters importing torch (seconds on
# 2 cores). The server is started by the first launch and serves every later one in this process.
_PRELOAD = ["torch", "torch.distributed", "xirang", "xirang.codegen.runtime.launch.launcher",
            "xirang.codegen.runtime.compiled_model"]


def _start_context():
    """The forkserver context where the platform has one (Linux, macOS), else spawn. A fork of the
    server is a clean child: it never ran torch ops or joined a process group, and it takes this
    process's sys.path, working directory and (in _rank_main) environment like a spawned one."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + (["transformers"] if "transformers" in sys.modules else []))
    return ctx


class _Terminated(BaseException):
    """SIGTERM reached the launching process: stop every rank, then exit as the signal asks."""


@contextlib.contextmanager
def _sigterm_stops_ranks():
    """While ranks run, SIGTERM raises in the launching thread, so ``launch``'s cleanup stops every
    rank before the process exits (only from the main thread, where Python delivers signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except _Terminated:
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _collect(procs, readers, deadline, heartbeat_s: float = HEARTBEAT_S):
    """Read each rank's messages until all results arrived, one failed (plus a grace), or the deadline.

    Failures come back root cause first: ranks that died (exit, signal) or froze (no heartbeat for
    ``heartbeat_s``) before ranks that raised, since a rank gone silent makes its peers raise in
    their next collective, never the reverse; among ranks that raised, the earliest first.
    """
    results, failures, pending, grace_end = {}, [], dict(readers), None
    heard = {rank: time.monotonic() for rank in readers.values()}
    while pending:
        now = time.monotonic()
        if grace_end is not None:
            deadline = min(deadline, grace_end)
        if now >= deadline:
            break
        for conn in wait(list(pending), timeout=min(deadline - now, heartbeat_s / _BEATS_PER_INTERVAL)):
            rank = pending[conn]
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                pending.pop(conn)
                procs[rank].join(timeout=5)
                failures.append(((0, 0.0), rank, _describe_exit(procs[rank].exitcode), ""))
                continue
            heard[rank] = time.monotonic()
            if message[0] == "beat":
                continue
            pending.pop(conn)
            if message[0] == "ok":
                results[rank] = pickle.loads(message[1])
            else:  # Xirang's own errors explain themselves: their traceback only on request
                shown = "" if message[4] and not tracebacks_wanted() else message[2]
                failures.append(((1, message[3]), rank, f"raised {message[1]}", shown))
        now = time.monotonic()
        for conn, rank in list(pending.items()):
            if now - heard[rank] > heartbeat_s:
                pending.pop(conn)
                procs[rank].kill()  # SIGKILL also ends a stopped process; SIGTERM would wait for SIGCONT
                failures.append(((0, 0.0), rank, f"stopped answering: no heartbeat for {now - heard[rank]:.1f} s "
                                                 f"(heartbeat_s={heartbeat_s}); it was stopped (SIGSTOP, a debugger), "
                                                 f"frozen, or starved of CPU", ""))
        if failures and grace_end is None:
            grace_end = time.monotonic() + _GRACE_S
    if not failures:
        return results, [(rank, None, "") for rank in sorted(pending.values())]  # deadline passed
    return results, [(rank, text, trace) for _, rank, text, trace in sorted(failures, key=lambda f: f[0])]


def _stop_all(procs, wait_s: float) -> None:
    end = time.monotonic() + wait_s
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _launch_error(failures, nprocs, timeout_s, pg_timeout_s, where) -> XirangError:
    """``failures``: (rank, what it did or None where the deadline stopped it, its traceback or "")."""
    if all(text is None for _, text, _ in failures):
        ranks = [rank for rank, _, _ in failures]
        # Every rank was alive to the end (a frozen one is named by its heartbeat) and none raised: a
        # collective left waiting raises after pg_timeout_s, so only a limit at or below it leaves that open.
        waiting = ("; if the ranks may be waiting on each other, give pg_timeout_s below timeout_s so a collective "
                   "left waiting raises in its rank first, with its traceback" if pg_timeout_s >= timeout_s else "")
        return XirangError(
            f"the run exceeded timeout_s={timeout_s:g} s (the whole-run limit given to launch): "
            f"{_ranks(ranks)} of {nprocs} {'was' if len(ranks) == 1 else 'were'} still running and terminated",
            where=where,
            hint=f"raise timeout_s, or pass timeout_s=None for no whole-run limit (a frozen rank is still named "
                 f"by its heartbeat){waiting}")
    grouped: dict = {}  # what a rank reported -> the ranks that reported it; reports in failure order
    for rank, text, trace in failures:
        if text is not None:
            grouped.setdefault((text, trace), []).append(rank)
    lines = [f"{_ranks(ranks)} {text}" + (f"\n{trace}" if trace else "") for (text, trace), ranks in grouped.items()]
    first = failures[0][0]
    return XirangError(
        f"rank {first} of {nprocs} failed; the other ranks were terminated.\n" + "\n".join(lines),
        where=where,
        hint=f"fix the error of rank {first} first: ranks listed after it often failed only "
             f"because a peer stopped answering")


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"


def launch_command(script: str, nprocs: int, script_args: Sequence[str] = ()) -> list:
    """argv that runs ``script`` on ``nprocs`` local ranks with torch's launcher (torchrun)."""
    nprocs = int(nprocs)  # a CLI WorldArg ("2x4") is its rank count here
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nprocs), str(script), *map(str, script_args)]


def ensure_distributed(world_size: int, *, backend: Optional[str] = None,
                       timeout_s: float = 1800.0, script: Optional[str] = None,
                       script_args: Optional[Sequence[str]] = None) -> tuple:
    """Inside a rank: join the world torchrun set up and return ``(rank, world_size)``.

    A one-rank program needs no process group and gets ``(0, 1)``. A program asking for more
    ranks outside a distributed launch gets an ``XirangError`` with the exact command to run it.
    """
    script = script if script is not None else (sys.argv[0] or "<your script>")
    script_args = list(sys.argv[1:] if script_args is None else script_args)
    command = shlex.join(launch_command(script, world_size, script_args))
    if dist.is_available() and dist.is_initialized():
        current = dist.get_world_size()
        _check_world(current, world_size, script, command)
        return dist.get_rank(), current
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is None or "RANK" not in os.environ:
        if world_size == 1:
            return 0, 1
        raise XirangError(
            f"this program needs {world_size} ranks but runs as a single process: "
            f"RANK and WORLD_SIZE are not set, so it was not started by a distributed launcher",
            where=script,
            hint=f"launch it with:\n    {command}\n  (on several nodes replace --standalone with "
                 f"--nnodes and --rdzv-endpoint; for CPU ranks from Python use "
                 f"xirang.launch(fn, {world_size}))")
    _check_world(int(env_world), world_size, script, command)
    if world_size == 1:
        return 0, 1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), world_size


def _check_world(actual: int, wanted: int, script: str, command: str) -> None:
    if actual != wanted:
        raise XirangError(
            f"this program needs {wanted} ranks but was launched with {actual}",
            where=script,
            hint=f"launch it with:\n    {command}\n  or plan for a mesh of {actual} ranks")
