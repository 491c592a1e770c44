"""The local launcher: results in rank order, and failing ranks reported by rank, never a hang.

Ranks are forks of a preloaded forkserver; this file launches a good run, a rank that raises, a
rank that dies with os._exit, one that never returns, one that is frozen (SIGSTOP), and sends
SIGTERM to a running `xirang run`.
"""
from __future__ import annotations

import inspect
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from xirang.codegen.runtime.launch.launcher import DEFAULT_PG_TIMEOUT_S, ensure_distributed, launch, launch_command
from xirang.ir.errors import XirangError


def _report(rank, world, tag):
    if rank == 0:
        time.sleep(0.3)  # rank 0 answers last: the result order must not be arrival order
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"rank": rank, "world": world, "tag": tag, "env_rank": os.environ["RANK"],
            "sum": total.item(), "backend": dist.get_backend()}


def _raise_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits on rank 1 and must be stopped, not left hanging


def _exit_on_rank_1(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _never_returns(rank, world):
    time.sleep(600)


class _BreaksInRank1:
    """Pickles in the parent; rebuilding it in rank 1 raises (as a module that rank cannot import
    would)."""

    def __reduce__(self):
        return (_rebuild, ())


def _rebuild():
    if os.environ.get("RANK") == "1":
        raise RuntimeError("cannot rebuild the argument here")
    return "rebuilt"


def _echo(rank, world, value):
    return value


def test_arguments_that_fail_to_rebuild_in_a_rank_are_that_ranks_reported_error():
    with pytest.raises(XirangError) as error:
        launch(_echo, 2, args=(_BreaksInRank1(),), timeout_s=60)
    assert "rank 1 of 2 failed" in error.value.what
    assert "RuntimeError: cannot rebuild the argument here" in error.value.what


def test_results_come_back_in_rank_order():
    results = launch(_report, 2, args=("hello",), timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["tag"] == "hello" and r["backend"] == "gloo" for r in results)
    assert [r["env_rank"] for r in results] == ["0", "1"]
    assert all(r["sum"] == 3.0 for r in results)


def test_a_raising_rank_is_named_with_its_traceback():
    with pytest.raises(XirangError) as info:
        launch(_raise_on_rank_1, 2, timeout_s=60)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed")
    assert "ValueError: boom on purpose" in message
    assert 'raise ValueError("boom on purpose")' in message  # the traceback's source line
    assert "_raise_on_rank_1" in info.value.where


def test_a_rank_that_exits_is_named_with_its_exit_code():
    # pg_timeout_s bounds rank 0's barrier too; launch must report well within timeout_s.
    with pytest.raises(XirangError) as info:
        launch(_exit_on_rank_1, 2, timeout_s=20, pg_timeout_s=20)
    assert str(info.value).startswith("rank 1 of 2 failed")
    assert "rank 1 exited with code 3 before returning a result" in str(info.value)


def test_a_run_past_its_timeout_s_is_named_as_such_not_blamed_on_a_collective():
    # The deadline may pass while the rank is still importing torch; either way it never returns.
    # The rank ran one function and called no collective: the message says the run was too long.
    with pytest.raises(XirangError) as info:
        launch(_never_returns, 1, timeout_s=4)
    assert info.value.what.startswith("the run exceeded timeout_s=4 s"), info.value.what
    assert "rank 0 of 1 was still running" in info.value.what
    assert "collective its peers never call" not in str(info.value)
    assert "timeout_s=None" in info.value.hint


def _collective_timeout(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def test_no_whole_run_limit_by_default_and_collectives_still_time_out():
    """A whole-run limit is a choice: none unless timeout_s is given. A collective its peers never
    call still raises, after the process-group timeout (DEFAULT_PG_TIMEOUT_S, or timeout_s when given)."""
    assert inspect.signature(launch).parameters["timeout_s"].default is None
    assert launch(_collective_timeout, 1) == [DEFAULT_PG_TIMEOUT_S] and DEFAULT_PG_TIMEOUT_S >= 300
    assert launch(_collective_timeout, 1, timeout_s=40) == [40.0]
    assert launch(_collective_timeout, 1, pg_timeout_s=30) == [30.0]


def _raise_xirang(rank, world, ranks):
    if rank in ranks:
        raise XirangError("the plan does not fit this rank", where="the plan", hint="re-plan")
    dist.barrier()


def test_a_xirang_error_in_a_rank_is_shown_without_its_traceback_and_once(monkeypatch):
    """Xirang's own errors explain themselves: no traceback (unless XIRANG_DEBUG=1), and the same
    explanation from several ranks is printed once, naming the ranks."""
    monkeypatch.delenv("XIRANG_DEBUG", raising=False)
    with pytest.raises(XirangError) as info:
        launch(_raise_xirang, 2, args=((0, 1),), timeout_s=60)
    message = str(info.value)
    assert "Traceback" not in message and "raise XirangError" not in message, message
    assert message.count("the plan does not fit this rank") == 1, message
    assert "ranks 0, 1 raised XirangError: the plan does not fit this rank" in message, message
    monkeypatch.setenv("XIRANG_DEBUG", "1")
    with pytest.raises(XirangError) as info:
        launch(_raise_xirang, 2, args=((1,),), timeout_s=60)
    assert "Traceback (most recent call last)" in str(info.value)
    assert 'raise XirangError("the plan does not fit this rank"' in str(info.value)


def _stop_rank_1(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, silent, never answering
    dist.barrier()


def test_a_stopped_rank_is_named_within_the_heartbeat_interval():
    """SIGSTOP freezes rank 1's heartbeat thread with the rest of it: the launch names rank 1 as
    frozen once its heartbeat has been silent for heartbeat_s (3 s), long before the deadline. The message
    tells which fired: the 120 s deadline says the launch timed out, not that a rank stopped answering."""
    with pytest.raises(XirangError) as info:
        launch(_stop_rank_1, 2, timeout_s=120, pg_timeout_s=120, heartbeat_s=3)
    assert str(info.value).startswith("rank 1 of 2 failed"), str(info.value)
    assert "rank 1 stopped answering: no heartbeat for" in str(info.value)


def _descendants(pid: int) -> set:
    """Every live process whose chain of parents reaches ``pid`` (read from /proc)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                parent_of[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.matrix  # slower end-to-end run: the -m matrix tier
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_xirang_run_leaves_no_process_behind():
    """What timeout, CI and Slurm send: the ranks and the forkserver go with the parent (none is left)."""
    run = subprocess.Popen([sys.executable, "-m", "xirang", "run", "examples/catalog.py:gpt_tiny", "--world", "2",
                            "--steps", "100000", "--timeout", "600"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).parents[2])
    try:
        assert run.stdout.readline().startswith("plan:")  # the ranks are being started
        deadline = time.monotonic() + 120
        while len(_descendants(run.pid)) < 3 and time.monotonic() < deadline:  # forkserver + 2 ranks
            time.sleep(0.5)
        children = _descendants(run.pid)
        assert len(children) >= 3, children
        time.sleep(2)  # let the ranks train
        run.send_signal(signal.SIGTERM)
        end = time.monotonic() + 60  # a wait, not a speed check: a leaked process outlives any wait
        while any(_alive(pid) for pid in children | {run.pid}) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)], "processes left behind after SIGTERM"
    finally:
        for pid in _descendants(run.pid) | {run.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        run.wait(timeout=10)


def test_unpicklable_function_is_refused_before_spawning():
    with pytest.raises(XirangError, match="define fn at the top level"):
        launch(lambda rank, world: rank, 2)
    with pytest.raises(XirangError, match="world=0 is not a number of ranks"):
        launch(_report, 0)


def test_launch_command_is_torchrun():
    assert launch_command("train.py", 4, ["--steps", 3]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "train.py", "--steps", "3"]


def test_ensure_distributed_outside_a_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ensure_distributed(1) == (0, 1)
    with pytest.raises(XirangError) as info:
        ensure_distributed(4, script="train.py", script_args=["--steps", "3"])
    command = shlex.join(launch_command("train.py", 4, ["--steps", "3"]))
    assert "needs 4 ranks but runs as a single process" in str(info.value)
    assert command in info.value.hint


def test_ensure_distributed_with_the_wrong_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(XirangError, match="needs 4 ranks but was launched with 2"):
        ensure_distributed(4, script="train.py", script_args=[])
