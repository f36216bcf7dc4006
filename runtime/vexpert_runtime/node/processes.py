"""The supervisor's dealings with its child processes and their queues: draining a queue, noticing
and naming a dead child, and stopping children (only its own, and every one of them)."""

from __future__ import annotations

import contextlib
import queue
import signal
import time
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
TERMINAL_INTERRUPT = frozenset({signal.SIGINT})  # for children that handle SIGTERM themselves (API servers)


@contextlib.contextmanager
def stop_signals_held(signals: frozenset[signal.Signals] = STOP_SIGNALS) -> Iterator[None]:
    """Start child processes with the stop signals blocked in the calling thread (children inherit the
    mask across fork and exec). A stop signal often reaches the whole process group, not only its leader:
    a terminal's Ctrl-C (SIGINT), and SIGTERM from systemd's ``KillMode=control-group`` (its default),
    ``timeout``, ``kill -- -PGID``. A child that took one — even while still importing, before its
    entry point runs — died (a KeyboardInterrupt traceback, or exit -15), and the node reported a
    failure and failed the requests in flight instead of draining them. The process that leads the
    group handles the signal and stops its children itself (join, then SIGKILL; ``PR_SET_PDEATHSIG``
    if it dies); each child's entry point calls :func:`ignore_stop_signals` with the same set — as
    multiprocessing starts its resource tracker, which ignores both."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals(signals: frozenset[signal.Signals] = STOP_SIGNALS) -> None:
    """In a child process: ignore ``signals`` (a pending one is dropped), then unblock them."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def drain(results: Any, timeout: float) -> list[Any]:
    """Every message now in the queue (waiting up to ``timeout`` for the first)."""
    try:
        batch = [results.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            batch.append(results.get_nowait())
        except queue.Empty:
            return batch


def check_alive(procs: list[Any]) -> None:
    for proc in procs:
        if proc.exitcode not in (None, 0):
            raise RuntimeError(exit_line(proc))


def exit_line(proc: Any) -> str:
    line = f"{proc.name} exited with code {proc.exitcode}"
    if proc.exitcode < 0:
        with contextlib.suppress(ValueError):
            line += f" (killed by {signal.Signals(-proc.exitcode).name})"
    return line


def first_dead(procs: list[Any], wait_s: float = 1.0) -> str | None:
    """The exit line of a worker that died, waiting briefly: when one worker is killed the others
    fail in their next collective, and the dead one is the cause worth reporting."""
    deadline = time.monotonic() + wait_s
    while True:
        for proc in procs:
            if proc.exitcode not in (None, 0):
                return exit_line(proc)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def stop_processes(procs: list[Any]) -> None:
    """Join our own children; kill whatever has not exited after 5 s (they ignore SIGTERM: see
    :func:`stop_signals_held`)."""
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
