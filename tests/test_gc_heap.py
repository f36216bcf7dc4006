"""The cyclic garbage collector in long-running processes (runtime/vexpert_runtime/gc_heap.py): a frozen
startup heap is out of every later collection's reach, what is made afterwards is still collected,
graph capture runs with the collector off, and the clock measures collections by generation."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from vexpert_runtime.gc_heap import GcClock, collector_paused, freeze_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> tuple[weakref.ref[_Node], int]:
    """A two-object reference cycle, dropped at once: only the cyclic collector frees it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a), id(a)


@pytest.fixture
def thawed() -> Iterator[None]:
    """Every frozen object back in the collected generations afterwards, the collector on."""
    was_enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if was_enabled:
        gc.enable()


def test_a_frozen_heap_is_not_traversed_and_later_cycles_are_still_collected(thawed: None) -> None:
    startup = [_Node() for _ in range(1000)]  # tracked objects of the "startup heap"
    kept, _ = _cycle()
    strong = kept()  # alive at the freeze
    frozen = freeze_heap()
    # frozen objects may still die by refcount (another thread's garbage), never come back
    assert frozen >= 1000 and gc.get_freeze_count() <= frozen
    tracked = {id(o) for o in gc.get_objects()}  # what a full collection traverses now
    assert not any(id(node) in tracked for node in startup)
    assert id(strong) not in tracked
    # a cycle made after the freeze is collected as before
    later, _ = _cycle()
    assert later() is not None
    gc.collect()
    assert later() is None
    # the price, and why only the startup heap is frozen: a frozen cycle dropped later stays
    del strong
    gc.collect()
    assert kept() is not None
    gc.unfreeze()
    gc.collect()
    assert kept() is None


def test_no_collection_runs_inside_collector_paused_and_the_collector_resumes(thawed: None) -> None:
    clock = GcClock().install()
    try:
        gc.enable()
        with collector_paused():
            assert not gc.isenabled()
            before = list(clock.collections)
            refs = [_cycle()[0] for _ in range(20_000)]  # far past generation 0's threshold (700)
            assert clock.collections == before
            assert all(ref() is not None for ref in refs[:10])  # uncollected garbage while paused
        assert gc.isenabled()
        gc.collect()
        assert all(ref() is None for ref in refs)
    finally:
        clock.uninstall()


def test_the_clock_counts_collections_by_generation() -> None:
    clock = GcClock().install()
    try:
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
        gc.collect(2)
        assert clock.collections[1] >= 1 and clock.collections[2] >= 2
        totals = clock.totals()
        assert all(seconds >= 0.0 for seconds in totals) and totals[2] > 0.0
    finally:
        clock.uninstall()
    counted = list(clock.collections)
    gc.collect(2)
    assert clock.collections == counted and clock.totals() == totals  # uninstalled: no longer counting


_EXIT_SCRIPT = """
import sys
from vexpert_runtime.gc_heap import freeze_heap

class Noisy:
    def __del__(self):
        sys.stdout.write("finalised\\n")

a, b = Noisy(), Noisy()
a.other, b.other = b, a  # a cycle: only the collector frees it
del a, b
import gc
gc.disable()  # the cycle survives until frozen
gc.freeze()   # as a cycle dropped after the freeze would be
gc.enable()
{triton}
freeze_heap()
"""


@pytest.mark.parametrize("with_triton", [False, True], ids=["plain", "triton"])
def test_a_frozen_heap_is_thawed_at_exit_so_finalisation_collects_it(with_triton: bool) -> None:
    """Without the thaw, a cycle in the permanent generation is never finalised, and Triton's
    nanobind bindings print ~100 lines of "nanobind: leaked" at every serving process's exit."""
    import subprocess
    import sys

    if with_triton:
        pytest.importorskip("triton")
    script = _EXIT_SCRIPT.format(triton="import triton" if with_triton else "")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr[:2000]
    assert proc.stdout.count("finalised") == 2, proc.stdout
