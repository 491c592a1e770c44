"""Run the check's classes of ranks side by side, each in a forked child process.

Each class's lowering and dry-run step is independent of the others, and each holds a Python process's
one core while it runs, so up to ``workers`` children run at once. A child is forked (it inherits the traced
graph, the plan and the test's fault injections without pickling them) and sends back only its result;
one that raises sends its error, one that dies is named with its exit code, and none outlives the check.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import wait
from typing import Callable, Sequence


def _child(job: Callable, writer) -> None:
    try:
        writer.send(("ok", job()))
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the parent, named
        writer.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc(limit=8)))
    finally:
        writer.close()
        os._exit(0)  # no atexit handlers of the parent's (torch.distributed, pytest) in the child


def run_jobs(jobs: Sequence[Callable], workers: int) -> list:
    """Each job's ``("ok", result)`` or ``("error", message, traceback)``, in order; ``workers`` at a time
    (1: in this process, no fork)."""
    if workers <= 1 or len(jobs) <= 1:
        results = []
        for job in jobs:
            try:
                results.append(("ok", job()))
            except Exception as error:  # noqa: BLE001 - the same answer as a child's
                results.append(("error", f"{type(error).__name__}: {error}", traceback.format_exc(limit=8)))
        return results
    context = mp.get_context("fork")
    results: list = [None] * len(jobs)
    pending = list(enumerate(jobs))
    running: dict = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                index, job = pending.pop(0)
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(target=_child, args=(job, writer), daemon=True)
                process.start()
                writer.close()
                running[reader] = (index, process)
            for reader in wait(list(running)):
                index, process = running.pop(reader)
                try:
                    results[index] = reader.recv()
                except EOFError:
                    process.join()
                    results[index] = ("error", f"the worker died (exit code {process.exitcode})", "")
                process.join()
                reader.close()
    finally:
        for _, process in running.values():
            process.kill()
    return results
