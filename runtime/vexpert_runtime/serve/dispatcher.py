"""How the API reaches the ranks: the :class:`Dispatcher` interface and its in-process implementation.

The API only ever calls a dispatcher: ``await submit(request)`` (refusals raise before any event),
iterate the returned async iterator of event batches — each a list of :class:`~.events.Event`, every
event that had arrived when the API took the batch — until the one with a ``finish_reason``, ``cancel(request_id)`` when the client goes away, ``ready()`` for ``/health``,
``loads()`` for the gauges and ``await shutdown(drain_timeout_s)`` on stop.

The node's dispatcher (:class:`~.multirank.MultiRankDispatcher`) sends the (picklable)
:class:`~.events.GenerationRequest` to the least-loaded rank (``RankLoad.score``), whose loop calls
``scheduler.run_iteration()`` in lockstep and whose event sink puts each :class:`~.events.Event` on a
queue back to the API process, where a reader routes it to the request's :class:`EventChannel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from vexpert_runtime.serve.events import Event, GenerationRequest, RankLoad

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # an idle single-rank loop sleeps until a submit wakes it (or this long)
_DRAIN_POLL_S = 0.02
_ABORT_GRACE_S = 10.0  # how long shutdown waits for the step in progress (a hung step: give up, daemon thread)


class Dispatcher(Protocol):
    """The API's view of the ranks."""

    async def submit(self, request: GenerationRequest) -> AsyncIterator[list[Event]]:
        """Queue a request; return its events in batches (the last event has a ``finish_reason``).

        Raises :class:`~.events.ServeRefusal` (429 / 503) or
        :class:`~vexpert_runtime.errors.VExpertInputError` (400) before anything runs.
        """
        ...

    def cancel(self, request_id: str) -> None:
        """Stop a request whose client went away and free its sequence."""
        ...

    def ready(self) -> str | None:
        """None when requests can be served, else the reason (for ``/health``)."""
        ...

    def loads(self) -> list[RankLoad]:
        """Each rank's load."""
        ...

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_timeout_s``, abort the
        rest (``finish_reason="abort"``), then stop the ranks."""
        ...


@dataclass(frozen=True)
class RankRefused:
    """Rank → API: the rank did not queue ``request_id``. ``status`` 429 / 503 (a
    :class:`~.events.ServeRefusal`: ``message``, ``retry_after_s``, ``code``) or 400 (a request no
    rank can run: ``field`` names the parameter, ``message`` says what is wrong with it, without the name)."""

    rank: int
    request_id: str
    status: int
    message: str
    retry_after_s: int = 1
    code: str = "overloaded"
    field: str | None = None


@dataclass(frozen=True)
class RankCapacity:
    """Rank → API, once at start: how many requests it runs in one batch and queues beyond that
    (the API admits at most ``max_running + max_waiting`` in-flight requests per rank)."""

    rank: int
    max_running: int
    max_waiting: int


class EventChannel:
    """One request's events, handed over from a producer thread to the event loop.

    :meth:`put` may be called from any thread; iterating ends after the finishing event (events after
    it are dropped). The events wait in a list the reader takes whole, and the reader waits on a
    future only when the list is empty: an ``asyncio.Queue`` — a wake-up bookkeeping per ``put`` and
    per ``get`` — was ~15 % of the API process's CPU per request at 256 streams.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._arrived: list[Event] = []
        self._waiter: asyncio.Future[None] | None = None
        self._finished = False

    def put(self, event: Event) -> None:
        """Thread-safe; raises RuntimeError once the loop is closed (the scheduler then cancels)."""
        self._loop.call_soon_threadsafe(self._deliver, event)

    def _deliver(self, event: Event) -> None:
        """On the loop: keep ``event`` for the reader and wake it if it waits."""
        if self._finished:
            return
        self._finished = event.finished
        self._arrived.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # (cancelled with its reader)
                waiter.set_result(None)

    @staticmethod
    def put_all(deliveries: Sequence[tuple[EventChannel, Event]]) -> None:
        """Thread-safe :meth:`put` of many events with one wake-up of each event loop, not one per
        event (at hundreds of streams a wake-up per token was a third of the reader thread's time);
        a closed loop's events are dropped (its requests are being cancelled)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[EventChannel, Event]]] = {}
        for channel, event in deliveries:
            by_loop.setdefault(channel._loop, []).append((channel, event))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_each, items)

    async def __aiter__(self) -> AsyncIterator[list[Event]]:
        """The events in batches: the next one (waiting for it), with every other that had arrived
        by then — when the API falls behind the ranks (hundreds of streams), one batch is one
        socket write instead of one per token. Ends after the finishing event."""
        while True:
            if not self._arrived:
                waiter = self._waiter = self._loop.create_future()
                await waiter
            batch, self._arrived = self._arrived, []
            yield batch
            if batch[-1].finished:
                return


def _put_each(items: list[tuple[EventChannel, Event]]) -> None:
    for channel, event in items:
        channel._deliver(event)
