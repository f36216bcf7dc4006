"""The API process's :class:`~.dispatcher.Dispatcher` over a node's ranks (worker processes).

Each request goes to the least-loaded rank (:attr:`~.events.RankLoad.score` of its latest report)
on that rank's queue; one reader thread takes every rank's events and load reports off the node's
outbound queue and routes events to their request's :class:`~.dispatcher.EventChannel`. Cancels and
the shutdown's stop / abort are control messages on the same queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from vexpert_runtime.serve.dispatcher import EventChannel
from vexpert_runtime.serve.events import (
    AbortAll,
    CancelRequest,
    Event,
    GenerationRequest,
    RankEvent,
    RankLoad,
    RankLoadReport,
    StopAccepting,
    overloaded,
    shutting_down,
)

log = logging.getLogger(__name__)

_POLL_S = 0.05
_DRAIN_POLL_S = 0.02


class MultiRankDispatcher:
    """Dispatch to ``len(requests)`` ranks.

    Args:
        requests: one inbound queue per rank. events: the ranks' shared outbound queue.
        max_waiting: a rank's queue bound (requests beyond it on every rank: 429).
        node_ready: the node's own readiness (None = serving, else why not), e.g.
            :meth:`~vexpert_runtime.node.NodeRuntime.readiness`.
        on_drained: called once the drain is over (stops the node).
    """

    def __init__(self, requests: list[Any], events: Any, max_waiting: int,
                 node_ready: Callable[[], str | None], on_drained: Callable[[], None]) -> None:
        self.requests = requests
        self.events = events
        self.max_waiting = max_waiting
        self.node_ready = node_ready
        self.on_drained = on_drained
        self._loads: dict[int, RankLoad] = {}
        self._channels: dict[str, tuple[int, EventChannel]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="vexpert-serve-events", daemon=True)
        self._reader.start()

    # -- the reader thread --------------------------------------------------------------------

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                msg = self.events.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            except (EOFError, OSError, ValueError):  # the queue was closed under us
                return
            if isinstance(msg, RankLoadReport):
                with self._lock:
                    self._loads[msg.rank] = msg.load
            elif isinstance(msg, RankEvent):
                for event in msg.events:
                    self._route(event)

    def _route(self, event: Event) -> None:
        with self._lock:
            entry = self._channels.get(event.request_id)
            if entry is not None and event.finished:
                del self._channels[event.request_id]
        if entry is None:
            return  # cancelled meanwhile
        with contextlib.suppress(RuntimeError):  # the client's event loop is gone
            entry[1].put(event)

    # -- Dispatcher ---------------------------------------------------------------------------

    def _choose(self) -> int:
        """The least-loaded rank; 429 when every rank's queue is full."""
        with self._lock:
            loads = {rank: self._loads.get(rank, RankLoad()) for rank in range(len(self.requests))}
            # requests sent since a rank's last report count as waiting there
            pending = {rank: 0 for rank in loads}
            for rank, _ in self._channels.values():
                pending[rank] += 1
        open_ranks = [r for r, load in loads.items() if load.waiting < self.max_waiting]
        if not open_ranks:
            raise overloaded(self.max_waiting)
        return min(open_ranks, key=lambda r: (pending[r], loads[r].score))

    async def submit(self, request: GenerationRequest) -> AsyncIterator[Event]:
        if self._stopping:
            raise shutting_down()
        rank = self._choose()
        channel = EventChannel(asyncio.get_running_loop())
        with self._lock:
            self._channels[request.request_id] = (rank, channel)
        self.requests[rank].put(request)
        return channel.__aiter__()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            entry = self._channels.pop(request_id, None)
        if entry is not None:
            self.requests[entry[0]].put(CancelRequest(request_id))

    def ready(self) -> str | None:
        if self._stopping:
            return "shutting down"
        reason = self.node_ready()
        if reason is not None:
            return reason
        with self._lock:
            reported = len(self._loads)
        if reported < len(self.requests):
            return f"{reported}/{len(self.requests)} ranks have loaded the model"
        return None

    def loads(self) -> list[RankLoad]:
        with self._lock:
            return [self._loads.get(rank, RankLoad()) for rank in range(len(self.requests))]

    def fail_all(self, message: str) -> None:
        """The ranks are gone (the node failed): end every request now with an error event
        instead of letting its client wait for tokens that will not come."""
        self._stopping = True
        with self._lock:
            channels, self._channels = list(self._channels.items()), {}
        for request_id, (_, channel) in channels:
            with contextlib.suppress(RuntimeError):
                channel.put(Event(request_id, finish_reason="error", error=message))

    def in_flight(self) -> int:
        with self._lock:
            return len(self._channels)

    async def shutdown(self, drain_timeout_s: float) -> None:
        self._stopping = True
        for inbound in self.requests:
            inbound.put(StopAccepting())
        deadline = time.monotonic() + drain_timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if self.in_flight():
            log.warning("drain timeout (%.1f s): aborting %d requests", drain_timeout_s, self.in_flight())
            for inbound in self.requests:
                inbound.put(AbortAll("server shut down before the request finished"))
            deadline = time.monotonic() + 10.0
            while self.in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(_DRAIN_POLL_S)
        self.on_drained()

    def close(self) -> None:
        """Stop the reader thread (after the node stopped)."""
        self._closed.set()
        self._reader.join(timeout=2.0)
