"""Names of the POSIX named semaphores a ``vexpert`` run creates in ``/dev/shm``.

``multiprocessing`` names every semaphore it creates (queues, locks, the node's doorbells)
``/dev/shm/sem.mp-<random>``, as every other Python program on the machine does; a leak or a
check for one could not tell a run's objects from theirs. :func:`name_semaphores_by_run` gives
them the ``vexpert`` process's pid: ``sem.mp-vexpert<pid>-<random>``. Processes it spawns inherit
the setting (``multiprocessing`` copies it into each child), so one run's whole process tree shares
one prefix.
"""

from __future__ import annotations

import multiprocessing
import os


def run_semaphore_prefix(pid: int) -> str:
    """The ``/dev/shm`` name prefix of the semaphores of the run whose ``vexpert`` process is ``pid``."""
    return f"sem.mp-vexpert{pid}-"


def name_semaphores_by_run() -> str:
    """Name this process's (and its spawned children's) semaphores after its pid; returns the
    prefix their ``/dev/shm`` entries carry. Where ``multiprocessing`` keeps no such setting (not
    CPython), names stay as they were."""
    config = getattr(multiprocessing.current_process(), "_config", None)
    if isinstance(config, dict) and "semprefix" in config:
        config["semprefix"] = f"/mp-vexpert{os.getpid()}"  # multiprocessing appends "-<random>"
    return run_semaphore_prefix(os.getpid())
