"""Leak checks of ``/dev/shm`` that count only one run's objects, and a stand-in for the other
Python programs of a shared machine.

``/dev/shm`` is machine-wide: any Python program's ``multiprocessing`` queues and locks appear
there as ``sem.mp-<random>`` while they live. A check of "what appeared since the run started"
counts them as the run's leaks. A ``vexpert`` run names its semaphores after the pid of its
``vexpert`` process (:mod:`vexpert_runtime.shm_names`), and torch names a shared tensor's file
(``file_system`` sharing) ``torch_<pid>_…`` after the process that made it: those are the names
a run can leak, and the only ones counted here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from vexpert_runtime.shm_names import run_semaphore_prefix

SHM = "/dev/shm"


def shm_names() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def run_objects(names: Iterable[str], root_pid: int, pids: Iterable[int] = ()) -> set[str]:
    """Of ``names``, the objects of the run whose ``vexpert`` process is ``root_pid`` and whose
    processes were ``pids``."""
    prefixes = (run_semaphore_prefix(root_pid), *(f"torch_{pid}_" for pid in {root_pid, *pids}))
    return {name for name in names if name.startswith(prefixes)}


def assert_run_has_named_semaphores(root_pid: int) -> None:
    """While the run lives, its semaphores exist under its prefix: else the leak check that
    follows would count nothing (the runtime stopped naming them, and the check went blind)."""
    assert run_objects(shm_names(), root_pid), (
        f"no /dev/shm/{run_semaphore_prefix(root_pid)}* while the run is up: "
        "the run's semaphores are not named after it")


def assert_run_left_nothing(root_pid: int, pids: Iterable[int], before: set[str], within_s: float = 3.0) -> None:
    """No object of the run is left in ``/dev/shm`` (one that is still going away gets ``within_s``)."""
    leaked = run_objects(shm_names() - before, root_pid, pids)
    deadline = time.monotonic() + within_s
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked &= shm_names()
    assert leaked == set(), f"leaked shared memory: {sorted(leaked)}"


# Another Python program on the machine: creates a multiprocessing lock every 20 ms (default
# names, sem.mp-<random>), drops each after about a second, and keeps every tenth until it is
# stopped, so new sem.mp-* entries appear all the time and some stay past any grace period. It ends
# by itself (objects removed) if the test process dies without stopping it.
_NOISE = """
import multiprocessing, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
ctx = multiprocessing.get_context("spawn")
recent, kept, made = [], [], 0
parent, until = os.getppid(), time.monotonic() + 600
print("ready", flush=True)
while os.getppid() == parent and time.monotonic() < until:  # never outlives the test session
    made += 1
    (kept if made % 10 == 0 else recent).append(ctx.Lock())
    del recent[:-50]
    time.sleep(0.02)
"""


@contextmanager
def other_programs_semaphores() -> Iterator[subprocess.Popen[str]]:
    """A Python program that keeps creating ``sem.mp-*`` objects beside the test, stopped (its
    objects removed) when the block ends."""
    noise = subprocess.Popen([sys.executable, "-c", _NOISE], stdout=subprocess.PIPE, text=True)
    try:
        assert noise.stdout is not None and noise.stdout.readline().strip() == "ready"
        yield noise
    finally:
        noise.send_signal(signal.SIGTERM)
        try:
            noise.wait(timeout=10)
        except subprocess.TimeoutExpired:
            noise.kill()
            noise.wait()


def noise_created_since(before: set[str]) -> set[str]:
    """The ``sem.mp-*`` objects that appeared since ``before`` and are not any run's."""
    return {n for n in shm_names() - before if n.startswith("sem.mp-") and not n.startswith("sem.mp-vexpert")}
