"""The API process's :class:`~.dispatcher.Dispatcher` over a node's ranks (worker processes).

Admission control is here, before anything is sent: the dispatcher counts the requests it sent to
each rank and has not seen finish (in flight); a rank is full at ``max_running + max_waiting`` in
flight (its :class:`~.dispatcher.RankCapacity`) or when its latest report shows a full queue; when
every rank is full ``submit`` raises 429 (``Retry-After``), while draining or once the node failed
503. Otherwise the request goes to the rank with the fewest in flight (then the lowest
:attr:`~.events.RankLoad.score`) — with prefix caching, to the rank that was sent the longest prefix of
its prompt unless that one carries too many more (:mod:`.prefix_routing`) — and ``submit`` returns once that rank queued it
(its :class:`~.events.RankEvent` lists it as accepted), so a rank's own refusal (:class:`~.dispatcher.RankRefused`)
is still an HTTP status — 429 / 503 / 400 — and never an error inside a started stream.

One reader thread takes every rank's events, acceptances, refusals and load reports off the node's
outbound queue and routes events to their request's :class:`~.dispatcher.EventChannel`. Cancels and
the shutdown's stop / abort are control messages on the same queues.

A dead rank (the node failed): :meth:`MultiRankDispatcher.fail_all` ends every request in flight at
once with ``finish_reason="abort"`` (the API's 503) and a message without the failure's internals,
and new requests get 503; the server then exits non-zero and the pod restarts (README, "A dead
worker").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve.dispatcher import EventChannel, RankCapacity, RankRefused
from vexpert_runtime.serve.events import (
    AbortAll,
    CancelRequest,
    Event,
    GenerationRequest,
    RankEvent,
    RankLoad,
    ServeRefusal,
    StopAccepting,
    overloaded,
    shutting_down,
)
from vexpert_runtime.serve.prefix_routing import PrefixAffinity

log = logging.getLogger(__name__)

_POLL_S = 0.05
_DRAIN_POLL_S = 0.02
NODE_FAILED = "the node failed: a rank process of this server died; it restarts, retry"


def node_down() -> ServeRefusal:
    """The refusal once a rank died (the server is about to exit and be restarted)."""
    return ServeRefusal(503, NODE_FAILED, 10, "node_failed")


class MultiRankDispatcher:
    """Dispatch to ``len(requests)`` ranks.

    Args:
        requests: one inbound queue per rank. events: the ranks' shared outbound queue.
        max_waiting: a rank's queue bound (requests beyond it on every rank: 429).
        max_running: a rank's batch bound; None: each rank's :class:`~.dispatcher.RankCapacity`.
        node_ready: the node's own readiness (None = serving, else why not), e.g.
            :meth:`~vexpert_runtime.node.NodeRuntime.readiness`.
        on_drained: called once the drain is over (stops the node).
        reply_to: this API server's index (``vexpert serve --api-servers``): the ranks send the
            events of the requests it submits to ``events``, its own queue.
        prefix_block_size: the ranks' KV block size when they cache prompt prefixes: a prompt then goes
            to the rank of its longest remembered prefix (:class:`PrefixAffinity`); None: least-loaded only.
    """

    def __init__(self, requests: list[Any], events: Any, max_waiting: int,
                 node_ready: Callable[[], str | None], on_drained: Callable[[], None],
                 max_running: int | None = None, reply_to: int = 0, prefix_block_size: int | None = None) -> None:
        self.requests = requests
        self.prefixes = PrefixAffinity(prefix_block_size) if prefix_block_size is not None else None
        self.reply_to = reply_to
        self.events = events
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.node_ready = node_ready
        self.on_drained = on_drained
        self._loads: dict[int, RankLoad] = {}
        self._capacity: dict[int, int] = {}  # rank → max_running + max_waiting, from RankCapacity
        self._channels: dict[str, tuple[int, EventChannel]] = {}
        self._in_flight = [0] * len(requests)  # per rank: sent, not yet seen finish (nor cancelled)
        self._acks: dict[str, asyncio.Future[None]] = {}  # submitted, not yet queued by the rank
        self._lock = threading.Lock()
        self._stopping = False
        self._failed = False
        self._was_ready = False
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
            if isinstance(msg, RankEvent):
                if msg.load is not None:  # first: whoever sees this iteration's events sees its load
                    with self._lock:
                        self._loads[msg.rank] = msg.load
                for request_id in msg.accepted:  # before the events: a request's first ones may be here
                    self._resolve(request_id, None)
                if msg.events:
                    EventChannel.put_all(self._route(msg.events))
            elif isinstance(msg, RankRefused):
                self._refused(msg)
            elif isinstance(msg, RankCapacity):
                with self._lock:
                    self._capacity[msg.rank] = msg.max_running + msg.max_waiting

    def _forget(self, request_id: str) -> tuple[int, EventChannel] | None:
        """Drop a request from the in-flight books (caller holds the lock)."""
        entry = self._channels.pop(request_id, None)
        if entry is not None:
            self._in_flight[entry[0]] -= 1
        return entry

    def _resolve(self, request_id: str, error: BaseException | None) -> None:
        """Wake the ``submit`` waiting for the rank to queue ``request_id`` (with ``error``: raise it)."""
        with self._lock:
            future = self._acks.pop(request_id, None)
        if future is None:
            return

        def settle() -> None:
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

        with contextlib.suppress(RuntimeError):  # the client's event loop is gone
            future.get_loop().call_soon_threadsafe(settle)

    def _refused(self, msg: RankRefused) -> None:
        with self._lock:
            self._forget(msg.request_id)
        error: BaseException
        if msg.status == 400:
            error = VExpertInputError(msg.field or "request", msg.message)
        else:
            error = ServeRefusal(msg.status, msg.message, msg.retry_after_s, msg.code)
        self._resolve(msg.request_id, error)

    def _route(self, events: Sequence[Event]) -> list[tuple[EventChannel, Event]]:
        """Where each of a rank's events goes (events of requests cancelled meanwhile go nowhere);
        a finishing event takes its request off the books."""
        deliveries = []
        for event in events:
            if event.finished:
                self._resolve(event.request_id, None)  # failed before the acceptance was seen
        with self._lock:
            for event in events:
                entry = self._channels.get(event.request_id)
                if entry is None:
                    continue  # cancelled meanwhile
                if event.finished:
                    self._forget(event.request_id)
                deliveries.append((entry[1], event))
        return deliveries

    # -- Dispatcher ---------------------------------------------------------------------------

    def _capacity_of(self, rank: int) -> int:
        if self.max_running is not None:
            return self.max_running + self.max_waiting
        return self._capacity.get(rank, self.max_waiting)

    def _choose(self, digests: list[bytes] | None = None) -> int:
        """The rank with the fewest requests in flight (then the lowest reported load) that is not
        full — or, given the prompt's block ``digests``, its prefix's rank within the affinity's slack;
        429 when every rank is full (caller holds the lock)."""
        open_ranks = []
        for rank in range(len(self.requests)):
            load = self._loads.get(rank, RankLoad())
            in_flight = self._in_flight[rank]
            # full: its whole capacity in flight, or its queue full and nothing of it finished since
            if in_flight >= self._capacity_of(rank) or (load.waiting >= self.max_waiting
                                                        and in_flight >= load.running + load.waiting):
                continue
            open_ranks.append((in_flight, load.score, rank))
        if not open_ranks:
            raise overloaded(self.max_waiting)
        least_loaded = min(open_ranks)[2]
        if self.prefixes is None or not digests:
            return least_loaded
        rank = self.prefixes.choose(digests, self._in_flight, [r for _, _, r in open_ranks], least_loaded)
        self.prefixes.record(digests, rank)
        return rank

    def _check_open(self) -> None:
        """503 while draining or once the node failed."""
        if self._failed:
            raise node_down()
        if self._stopping:
            raise shutting_down()
        if self._was_ready and self.node_ready() is not None:  # it served, and now a part is down
            raise node_down()

    async def submit(self, request: GenerationRequest) -> AsyncIterator[list[Event]]:
        self._check_open()
        if request.reply_to != self.reply_to:
            request = dataclasses.replace(request, reply_to=self.reply_to)
        loop = asyncio.get_running_loop()
        channel = EventChannel(loop)
        accepted: asyncio.Future[None] = loop.create_future()
        digests = self.prefixes.digests(request.prompt_ids, request.params.cache_salt) if self.prefixes is not None \
            else None
        with self._lock:
            rank = self._choose(digests)
            self._channels[request.request_id] = (rank, channel)
            self._in_flight[rank] += 1
            self._acks[request.request_id] = accepted
        try:
            self.requests[rank].put(request)
            await accepted  # the rank queued it, or raises its refusal
        except BaseException:  # refused, the client went away, or the queue is gone
            with self._lock:
                self._acks.pop(request.request_id, None)
                sent = self._forget(request.request_id) is not None
            if sent:
                with contextlib.suppress(Exception):
                    self.requests[rank].put(CancelRequest(request.request_id))
            raise
        return channel.__aiter__()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            entry = self._forget(request_id)
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
            return (f"{reported}/{len(self.requests)} ranks have loaded the model and run their first iteration "
                    "(CUDA graphs are captured there)")
        self._was_ready = True
        return None

    def loads(self) -> list[RankLoad]:
        with self._lock:
            return [self._loads.get(rank, RankLoad()) for rank in range(len(self.requests))]

    def fail_all(self, message: str) -> None:
        """The ranks are gone (the node failed): end every request now instead of letting its
        client wait for tokens that will not come — ``finish_reason="abort"`` (503) with a message
        that names no internals (``message``, the failure itself, goes to the log), and 503 for the
        requests not yet queued by their rank and for every new one."""
        log.error("failing %d requests in flight: %s", self.in_flight(), message)
        self._failed = True
        self._stopping = True
        with self._lock:
            channels, self._channels = list(self._channels.items()), {}
            self._in_flight = [0] * len(self.requests)
            pending = list(self._acks)
        for request_id in pending:
            self._resolve(request_id, node_down())
        for request_id, (_, channel) in channels:
            if request_id in pending:
                continue
            with contextlib.suppress(RuntimeError):
                channel.put(Event(request_id, finish_reason="abort", error=NODE_FAILED))

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
