"""How the API reaches the ranks: the :class:`Dispatcher` interface and its in-process implementation.

The API only ever calls a dispatcher: ``await submit(request)`` (refusals raise before any event),
iterate the returned async iterator of :class:`~.events.Event` until the one with a
``finish_reason``, ``cancel(request_id)`` when the client goes away, ``ready()`` for ``/health``,
``loads()`` for the gauges and ``await shutdown(drain_timeout_s)`` on stop.

:class:`InProcessDispatcher` runs one :class:`~.scheduler.Scheduler` on a background thread (a
single-rank server, and the tests). A multi-rank dispatcher keeps the same shape: it sends the
(picklable) :class:`~.events.GenerationRequest` to the least-loaded worker (``RankLoad.score``),
whose loop calls ``scheduler.run_iteration()`` every iteration in lockstep and whose event sink
puts each :class:`~.events.Event` on a queue back to the API process, where a reader routes it to
the request's :class:`EventChannel` by ``request_id``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Protocol

from vexpert_runtime.serve.events import Event, GenerationRequest, RankLoad, shutting_down
from vexpert_runtime.serve.scheduler import Scheduler

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # an idle single-rank loop sleeps until a submit wakes it (or this long)
_DRAIN_POLL_S = 0.02
_ABORT_GRACE_S = 10.0  # how long shutdown waits for the step in progress (a hung step: give up, daemon thread)


class Dispatcher(Protocol):
    """The API's view of the ranks."""

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Queue a request; return its events (the last one has a ``finish_reason``).

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


class EventChannel:
    """One request's events, handed over from a producer thread to the event loop.

    :meth:`put` may be called from any thread; iterating ends after the finishing event.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        """Thread-safe; raises RuntimeError once the loop is closed (the scheduler then cancels)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            event = await self._queue.get()
            yield event
            if event.finished:
                return


class InProcessDispatcher:
    """One scheduler on a background thread of this process.

    ``lockstep_idle``: step the model even with no work (what a rank of a multi-rank server must
    do); a lone rank can sleep instead.
    """

    def __init__(self, scheduler: Scheduler, lockstep_idle: bool = False) -> None:
        self.scheduler = scheduler
        self.lockstep_idle = lockstep_idle
        self.step_failures = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vexpert-serve-rank0", daemon=True)
        self._started = False

    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def _loop(self) -> None:
        """Iterate while there is work; a failed step is logged and the loop goes on."""
        while not self._stop.is_set():
            self._wake.clear()
            if not (self.lockstep_idle or self.scheduler.has_work()):
                self._wake.wait(_IDLE_WAIT_S)
                continue
            try:
                self.scheduler.run_iteration()
            except Exception:
                self.step_failures += 1
                log.exception("model step failed; its requests got an error, the rank goes on")

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Event]:
        if self._stop.is_set():
            raise shutting_down()
        channel = EventChannel(asyncio.get_running_loop())
        self.scheduler.submit(request, channel.put)
        self._wake.set()
        return channel.__aiter__()

    def cancel(self, request_id: str) -> None:
        self.scheduler.cancel(request_id)
        self._wake.set()

    def ready(self) -> str | None:
        if not self._thread.is_alive():
            return "the rank loop is not running"
        if self._stop.is_set():
            return "shutting down"
        return None

    def loads(self) -> list[RankLoad]:
        return [self.scheduler.load()]

    async def shutdown(self, drain_timeout_s: float) -> None:
        self.scheduler.stop_accepting()
        deadline = time.monotonic() + drain_timeout_s
        while self.scheduler.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if self.scheduler.has_work():
            log.warning("drain timeout (%.1f s): aborting the requests still running", drain_timeout_s)
            self.scheduler.abort_all("server shut down before the request finished")
            self._wake.set()
            # the abort lands at the start of the next iteration, after the step in progress
            deadline = time.monotonic() + _ABORT_GRACE_S
            while self.scheduler.has_work() and self._thread.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(_DRAIN_POLL_S)
        self._stop.set()
        self._wake.set()
        if self._started:
            await asyncio.to_thread(self._thread.join, _ABORT_GRACE_S)
