"""How many CPU threads a vexpert process gives torch, and how idle OpenMP threads wait.

Every process vexpert starts does its CPU work on small tensors (the simulator's [layers, experts]
loads, the allocator's per-layer plans, a CPU worker's few tokens per step): torch's OpenMP
intra-op threads buy little there and, by default, spin while they wait for the next parallel
region. On a machine whose cores are busy with other programs a spinning team burns its time slices
waiting for a descheduled member, so the work slows far more than the load explains (measured on a
2-core machine while other test suites ran, load average 7–12: a 120-iteration `vexpert simulate`
took 73–99 s wall and 32–36 s CPU with torch's default two spinning threads, 10–24 s and 5 s with
one thread or with passive waiting; benchmarks/README.md §11 "CPU threads under contention").

So before torch is imported, :func:`configure_cpu_threads` sets ``OMP_WAIT_POLICY=PASSIVE`` (idle
threads sleep instead of spinning) and one intra-op thread, unless the user chose otherwise:
``VEXPERT_THREADS=N`` gives torch N threads (it wins over everything), an explicit
``OMP_NUM_THREADS`` or ``OMP_WAIT_POLICY`` is kept. Child processes inherit the setting through
the environment; node workers and the coordinator pin themselves to one thread regardless.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

THREADS_ENV = "VEXPERT_THREADS"
DEFAULT_THREADS = 1


def cpu_threads(environ: MutableMapping[str, str] | None = None) -> int:
    """The intra-op thread count this process should use: ``VEXPERT_THREADS``, else an explicit
    ``OMP_NUM_THREADS``, else 1. A bad ``VEXPERT_THREADS`` is a :class:`VExpertInputError`."""
    from vexpert_runtime.errors import VExpertInputError

    env = os.environ if environ is None else environ
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value >= 1:
            return value
        if name == THREADS_ENV:
            raise VExpertInputError(THREADS_ENV, f"must be a whole number ≥ 1, got {raw!r}",
                                    f"unset it (one thread) or set e.g. {THREADS_ENV}=2")
    return DEFAULT_THREADS


def configure_cpu_threads(environ: MutableMapping[str, str] | None = None) -> int:
    """Apply the thread policy to this process (and, through the environment, its children).

    Call it before torch is imported: OpenMP reads ``OMP_WAIT_POLICY`` and ``OMP_NUM_THREADS``
    when torch loads it. If torch is already imported the thread count is still applied through
    ``torch.set_num_threads`` (the wait policy then stays whatever it was). Returns the count."""
    env = os.environ if environ is None else environ
    threads = cpu_threads(env)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["OMP_NUM_THREADS"] = str(threads)  # MKL follows OpenMP's count unless MKL_NUM_THREADS says otherwise
    torch = sys.modules.get("torch")
    if torch is not None and environ is None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
