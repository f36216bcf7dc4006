"""The supervisor's dealings with its child processes and their queues: draining a queue, noticing
and naming a dead child, and stopping children (only its own, and every one of them)."""

from __future__ import annotations

import contextlib
import queue
import signal
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def terminal_interrupt_held() -> Iterator[None]:
    """Start child processes with SIGINT blocked in the calling thread (children inherit the mask
    across fork and exec). A terminal's Ctrl-C goes to the whole foreground process group: a child
    that took it — even while still importing, before its entry point runs — died with a
    KeyboardInterrupt traceback, and the node reported a failure instead of stopping. The node's
    own process stops its children (join, SIGTERM, SIGKILL; ``PR_SET_PDEATHSIG`` if it dies);
    each child's entry point calls :func:`ignore_terminal_interrupt`."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_terminal_interrupt() -> None:
    """In a child process: ignore SIGINT (a pending one is dropped), then unblock it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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
    """Join workers; terminate, then kill, whatever does not exit (only our own children)."""
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
