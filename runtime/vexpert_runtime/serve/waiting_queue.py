"""The order a rank serves requests in: its waiting queue and its preemption victims (vLLM's
``--scheduling-policy``).

``fcfs`` (the default): requests are admitted as they arrived; a preempted sequence goes back first. ``priority``:
a request's ``priority`` (lower first; any integer, 0 by default), then its arrival — vLLM's order. Both policies
take the same path: a waiting request's place is :func:`order_key`, the queue is a heap on it, and when the running
decodes outgrow the KV cache the victim is the running sequence that comes *last* in that order (under ``fcfs`` the
newest; under ``priority`` the least urgent, the newest among equals, as vLLM v1 picks it). As in vLLM v1, priority
orders admission and preemption only: a waiting request does not preempt a running one to take its place in the batch.
A preempted sequence keeps its key, so it goes back to where it stood — before every request that arrived after it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Generic, Literal, TypeVar, get_args

from vexpert_runtime.errors import VExpertInputError

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)

T = TypeVar("T")


def check_policy(policy: str) -> None:
    """A :class:`VExpertInputError` naming ``scheduling_policy`` unless ``policy`` is one of the policies."""
    if policy not in SCHEDULING_POLICIES:
        raise VExpertInputError("scheduling_policy", f"{policy!r} is not a scheduling policy",
                                f"use one of {', '.join(SCHEDULING_POLICIES)}")


def order_key(policy: str, priority: int, arrival: int) -> tuple[int, int]:
    """Where a request stands in ``policy``'s order (lower: served sooner): ``fcfs`` by ``arrival`` alone (a
    number that grows as requests arrive), ``priority`` by (``priority``, ``arrival``)."""
    return (priority if policy == "priority" else 0, arrival)


class WaitingQueue(Generic[T]):
    """Requests waiting for a batch, in :func:`order_key`'s order (a heap: push and pop cost log n). Items are
    pushed with their key; a key is unique (its arrival number), so items themselves are never compared."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], T]] = []

    def push(self, key: tuple[int, int], item: T) -> None:
        heapq.heappush(self._heap, (key, item))

    def peek(self) -> T:
        """The item that comes first (IndexError when empty)."""
        return self._heap[0][1]

    def pop(self) -> T:
        """Take the item that comes first (IndexError when empty)."""
        return heapq.heappop(self._heap)[1]

    def remove(self, item: T) -> bool:
        """Take ``item`` out wherever it stands (a cancelled request); False if it is not queued."""
        for index, (_, queued) in enumerate(self._heap):
            if queued is item:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[T]:
        """The queued items in order (a sorted copy: for reports and tests, not the loop)."""
        return (item for _, item in sorted(self._heap, key=lambda entry: entry[0]))
