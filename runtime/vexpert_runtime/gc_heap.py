"""Python's cyclic garbage collector in vexpert's long-running processes.

A serving process builds a large heap once — a rank's model modules, tokenizer, compiled pieces
and CUDA graphs; the API process's tokenizer and web app — and then allocates short-lived objects
every iteration (batch items, events, messages). CPython's collector promotes what survives two
young collections to the oldest generation, and a full collection then traverses *every* tracked
object, the startup heap included: on a CPU rank of the tests' tiny DeepSeek-V3 (391,015 objects;
539,750 with its step compiled) one full collection took 160–178 ms (246–257 ms; benchmarks/gc_heap_cost.py), and at hundreds of streams a request's objects live long enough
to be promoted, so full collections recur while serving. Every rank of an EP group steps in
lockstep, so one rank's pause stalls the whole group's tokens.

So each process freezes its startup heap once it is built (:func:`freeze_heap`, as vLLM's
``freeze_gc_heap`` after its engine's start-up) — a worker before it reports ready (model,
tokenizer, torch) and on a GPU once more after iteration 0 (its compiled pieces and CUDA graphs;
on CPU iteration 0 builds nothing worth the pause, which would shift the slot protocol's timing at
the first iteration for nothing), the API process once it listens, ``vexpert serve``'s node process before its
runtime runs, a coordinator before its fill loop; only at the entry points of processes of their
own, never inside a class a caller may run in its own process: frozen objects sit in the permanent
generation, which no collection traverses (a cycle among them that is dropped later stays), while
the objects made afterwards are collected as before. CUDA
graph capture runs with the collector off (:func:`collector_paused`): a collection during capture
can free an object whose finaliser touches CUDA (a kernel module's unload, a tensor's free) inside
the capture, which invalidates the graph (vLLM's ``freeze_gc_for_cudagraph_capture``).

:class:`GcClock` measures what remains: the seconds this process spent in the collector, by
generation, exported with the process's other metrics.

A frozen heap is thawed at exit (:func:`freeze_heap` registers :func:`gc.unfreeze` with :mod:`atexit`):
objects left in the permanent generation are never collected at shutdown, so extension types that
check for leaks when the interpreter finalises (Triton's nanobind bindings) printed some 100 lines
of "nanobind: leaked …" from every serving process on Ctrl-C.
"""

from __future__ import annotations

import atexit
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def freeze_heap() -> int:
    """Collect every generation, then move all surviving tracked objects to the permanent
    generation (no later collection traverses them); returns how many objects are frozen."""
    gc.collect()  # generation 2: a full collection takes the younger ones with it
    gc.freeze()
    _thaw_at_exit()
    return gc.get_freeze_count()


def _thaw_at_exit() -> None:
    """Unfreeze the heap when the interpreter exits (once, however often the heap is frozen), so
    finalisation collects it as it would an unfrozen one."""
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block (what exists on entry is frozen, the collector disabled);
    on exit the collector runs as before (the objects frozen on entry stay frozen)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    _thaw_at_exit()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class GcClock:
    """Seconds this process spent in cyclic collections, by generation (``gc.callbacks``).

    :meth:`install` once per process; :attr:`seconds` and :attr:`collections` are running totals
    (the callbacks run on whichever thread triggers a collection, under the GIL)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started = 0.0

    def install(self) -> GcClock:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def totals(self) -> tuple[float, float, float]:
        """Seconds in collections of generation 0, 1 and 2 so far."""
        return (self.seconds[0], self.seconds[1], self.seconds[2])

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.seconds[generation] += time.perf_counter() - self._started
        self.collections[generation] += 1
