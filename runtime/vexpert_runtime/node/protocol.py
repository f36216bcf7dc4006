"""Coordinator–worker slot protocol: a header per iteration on the host, two flags per layer next to
the slots (one module; copies and flag operations go through a :class:`SlotTransport`).

Each worker owns one slot buffer of ``S = G·vmax`` expert slots with per-layer FREE/FULL flags
(:mod:`vexpert_runtime.node.slots`). Two levels:

**Per iteration, on the host** (shared memory, per worker, under that worker's robust mutex)::

    PUBLISHED – last iteration whose header the coordinator published (it then fills all its layers)
    SKIPPED   – last iteration the worker claimed to run without the coordinator
    FINISHED  – last iteration the worker has finished (on a GPU: the device has run it)

and a ring of ``HEADERS`` headers (``ITERATION, PLAN_ID, K, STOP, GENERATION``). At the start of
iteration ``t`` a worker waits (at most ``slot_fill_timeout_s``, not at all while no coordinator is
attached) until ``t`` is published; if it is not, it *claims* ``t`` (``SKIPPED = t``) under the mutex,
so the coordinator — which publishes under the same mutex and only if ``SKIPPED < t`` — never fills
it, and sets its own FULL flags. All workers then agree with one tiny collective (:func:`agree`): the
plan's slots are used only if every rank has ``t`` published under the same table; otherwise the
iteration runs on the static placement (degraded), still consuming the flags its own coordinator sets.
The coordinator publishes ``t`` only once ``FINISHED ≥ t − ahead``, ``ahead`` ≤ ``AHEAD`` < ``HEADERS``
(which keeps the header ring safe), set by the transport (``SlotTransport.publish_ahead``): 3 on a
GPU, where a worker that overlaps iterations (CUDA graphs) reports ``t − 2`` finished just before it
starts ``t`` — with 2 every iteration waited for the coordinator to wake up and publish (0.14–0.21 ms
per iteration on an H200, benchmarks/README.md §10, run 16); 2 on CPU, whose workers report each
iteration before the next. How far the fills themselves run ahead is bounded by the per-layer flags
below — except after a claimed iteration, whose FULL flags the worker set itself without taking its FREE
flags: the coordinator publishes ``t + 1`` only once a claimed ``t`` is finished (else a fill of ``t + 1``
would set FULL flags already set, which ``t`` consumes: the worker then waits for them forever); a new coordinator publishes nothing before every
iteration its predecessors published is finished (the workers may be rescuing one, reading slots
whose FREE flag was never claimed).

**Per layer, next to the slots** (on a GPU: stream operations, no CPU round trip)::

    coordinator, fill of layer l:  wait FREE[j] == 1 for every layer j whose slots l overwrites
                                   wait FREE[l] == 1 · FREE[l] ← 0 · copies · FULL[l] ← 1
    worker, layer l:               wait FULL[l] == 1 · FULL[l] ← 0 · compute · FREE[l] ← 1

The waits on other layers' FREE flags do not consume them: FREE[j] is 1 exactly when the worker has
finished the last use of j that the coordinator filled (the coordinator claims FREE[j] only when it
fills j again, later on the same stream). A new coordinator knows nothing of its predecessor's
layout, so its first fill of each worker waits for every layer's FREE flag.

**A coordinator that dies** leaves published iterations half filled. Every header carries the
coordinator's *generation* (bumped at each attach); a worker waiting for a FULL flag whose publisher
is gone fills that layer's slots itself from the checkpoint (slow, exact) and sets the flag — the
worker's *rescue*. A new coordinator resumes after the last iteration any worker published, skipped
or finished, so the two never fill the same iteration. A slot's tag, ``(layer, expert)``, is
written when its copy is enqueued and checked by the worker against its plan.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vexpert_runtime.model.ep_moe import RoutingTable
from vexpert_runtime.node.expert_pool import ExpertPool
from vexpert_runtime.node.gpu_sync import FlagOps, FlagWaitInterrupted, acquire, produce, release
from vexpert_runtime.node.slots import DONE, FREE, FULL, STARTED, SlotBuffers
from vexpert_runtime.node.transport import SlotTransport

PUBLISHED, SKIPPED, FINISHED = 0, 1, 2
NUM_FIELDS = 3
ITERATION, PLAN_ID, K_VALUE, STOP, GENERATION = range(5)
HEADER_FIELDS = 5
HEADERS = 4  # header ring: the coordinator publishes at most AHEAD iterations past the last finished
AHEAD = 3  # the most any transport's publish_ahead may be
LAYER, EXPERT = 0, 1


class RobustLocks:
    """One mutex per worker record that a dead holder cannot leave locked.

    A POSIX record lock on byte ``i`` of an anonymous ``memfd`` (no file system entry, nothing to
    leak): the kernel releases the locks of a process that dies, SIGKILL included, and the lock
    syscalls order memory like any mutex. Record locks belong to a process, so a thread lock per
    record excludes the threads of one process too. Pickled (at spawn, or through a
    ``multiprocessing`` queue) as a duplicate of the descriptor.
    """

    def __init__(self, count: int, fd: int | None = None) -> None:
        self.count = count
        self.fd = os.memfd_create("vexpert-protocol") if fd is None else fd
        self._threads = [threading.Lock() for _ in range(count)]

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_rebuild_locks, (self.count, DupFd(self.fd)))

    @contextlib.contextmanager
    def hold(self, index: int) -> Iterator[None]:
        with self._threads[index]:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, index)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, index)


def _rebuild_locks(count: int, dup: Any) -> RobustLocks:
    return RobustLocks(count, dup.detach())


def ring(bell: Any) -> None:
    """Wake whoever sleeps on ``bell`` (a semaphore); at most a couple of wake-ups stay pending."""
    with contextlib.suppress(NotImplementedError):  # get_value is missing on macOS only
        if bell.get_value() > 0:
            return
    bell.release()


@dataclass
class SharedState:
    """The protocol's host shared memory, created by the node and passed to workers (and to every
    coordinator process) at spawn.

    state: [W, NUM_FIELDS] int64 (PUBLISHED, SKIPPED, FINISHED); headers: [W, HEADERS, HEADER_FIELDS]
    int64; tags: [W, S, 2] int64 ((layer, expert) per slot, −1 empty); locks: one robust mutex per
    local worker; to_worker / to_coordinator: one doorbell semaphore per local worker and direction;
    coordinator: [1] int64, −1 until the first coordinator attached (workers wait for it before
    their first iteration), 1 while one is attached, 0 while none is (workers then neither wait for
    headers nor for flags); generation: [1] int64, bumped by every coordinator that attaches.
    """

    state: torch.Tensor
    headers: torch.Tensor
    tags: torch.Tensor
    locks: RobustLocks
    to_worker: list[Any]
    to_coordinator: list[Any]
    stop_at: torch.Tensor  # [1] int64: first iteration not to run (−1 = none); see :meth:`request_stop`
    coordinator: torch.Tensor
    generation: torch.Tensor

    @classmethod
    def create(cls, workers: int, slots: int, ctx: Any) -> SharedState:
        state = torch.full((workers, NUM_FIELDS), -1, dtype=torch.int64)
        headers = torch.full((workers, HEADERS, HEADER_FIELDS), -1, dtype=torch.int64)
        tags = torch.full((workers, max(slots, 1), 2), -1, dtype=torch.int64)
        return cls(
            state.share_memory_(),
            headers.share_memory_(),
            tags.share_memory_(),
            RobustLocks(workers),
            [ctx.Semaphore(0) for _ in range(workers)],
            [ctx.Semaphore(0) for _ in range(workers)],
            torch.full((1,), -1, dtype=torch.int64).share_memory_(),
            torch.full((1,), -1, dtype=torch.int64).share_memory_(),
            torch.zeros(1, dtype=torch.int64).share_memory_(),
        )

    @property
    def workers(self) -> int:
        return int(self.state.shape[0])

    def request_stop(self, iteration: int) -> None:
        """Ask workers to stop before ``iteration`` even if the coordinator is behind; they agree on it
        at their next iteration start."""
        current = int(self.stop_at[0])
        self.stop_at[0] = iteration if current < 0 else min(current, iteration)

    def attach_coordinator(self) -> int:
        """A coordinator attaches: returns its generation (the one its headers carry)."""
        self.generation[0] += 1
        self.coordinator[0] = 1
        self._wake_workers()
        return int(self.generation[0])

    def detach_coordinator(self) -> None:
        """The coordinator is gone (set by the node once its process exited): waiting workers wake,
        stop waiting for headers and rescue the layers it left unfilled."""
        self.coordinator[0] = 0
        self._wake_workers()

    def _wake_workers(self) -> None:
        for bell in self.to_worker:
            ring(bell)

    def coordinator_attached(self) -> bool:
        return int(self.coordinator[0]) != 0

    def publisher_alive(self, generation: int) -> bool:
        """Whether the coordinator of ``generation`` is still the attached one."""
        return int(self.coordinator[0]) == 1 and int(self.generation[0]) == generation

    def resume_iteration(self) -> int:
        """The first iteration a (new) coordinator may publish: after every iteration any worker has
        seen published, has skipped or has finished."""
        last = -1
        for worker in range(self.workers):
            with self.locks.hold(worker):
                last = max(last, int(self.state[worker].max()))
        return last + 1


@dataclass(frozen=True)
class Header:
    """What the coordinator announces for one iteration."""

    iteration: int
    plan_id: int
    k: int
    stop: bool
    generation: int


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------

Rescue = Callable[[int], None]  # layer ↦ fill this worker's slots of that layer itself, set its FULL flag


class WorkerSlots:
    """A worker's side of the protocol: its slot buffers, flags and host record.

    ``ops``/``stream``: the flag operations and the stream they are ordered on (the worker's compute
    stream on a GPU; None on CPU).
    """

    def __init__(self, shared: SharedState, worker: int, buffers: SlotBuffers, timeout_s: float, ops: FlagOps,
                 stream: Any = None) -> None:
        self.shared = shared
        self.worker = worker
        self.buffers = buffers
        self.timeout_s = timeout_s
        self.ops = ops
        self.stream = stream
        self._bell = shared.to_worker[worker]
        self._state = shared.state[worker]
        self._headers = shared.headers[worker]
        self.publisher: int | None = None  # generation whose fills the current iteration consumes
        self.layer_wait_s = 0.0  # CPU: time spent waiting for FULL flags (running total)

    @property
    def num_layers(self) -> int:
        return int(self.buffers.flags.shape[0])

    def begin(self, iteration: int) -> tuple[Header | None, float]:
        """Start ``iteration``: wait until the coordinator published it (or the timeout passes, or no
        coordinator is attached), else claim it and set this worker's FULL flags itself.

        Returns (header, or None when this worker runs the iteration without the coordinator;
        seconds waited).
        """
        start = time.perf_counter()
        deadline = start + self.timeout_s
        locks = self.shared.locks
        header: Header | None = None
        while True:
            with locks.hold(self.worker):
                if int(self._state[PUBLISHED]) >= iteration:
                    header = self._header(iteration)
                elif not self.shared.coordinator_attached() or time.perf_counter() >= deadline:
                    self._state[SKIPPED] = iteration  # the coordinator will not publish it now
            if header is not None or int(self._state[SKIPPED]) >= iteration:
                break
            self._bell.acquire(True, min(max(deadline - time.perf_counter(), 0.001), 0.1))
        self._write_progress(STARTED, 0)
        self._write_progress(DONE, 0)
        if header is None:
            self.publisher = None
            for layer in range(self.num_layers):
                self.ops.write(self.stream, self.buffers.flags, layer, FULL, 1)
        else:
            self.publisher = header.generation
        return header, time.perf_counter() - start

    def _header(self, iteration: int) -> Header:
        row = self._headers[iteration % HEADERS].tolist()
        if row[ITERATION] != iteration:
            raise RuntimeError(f"header of iteration {iteration} was overwritten (holds {row[ITERATION]}): protocol violated")
        return Header(row[ITERATION], row[PLAN_ID], row[K_VALUE], bool(row[STOP]), row[GENERATION])

    def publisher_gone(self) -> bool:
        """Whether the coordinator whose fills this iteration consumes is no longer attached."""
        return self.publisher is not None and not self.shared.publisher_alive(self.publisher)

    def acquire(self, layer: int, rescue: Rescue | None = None) -> None:
        """Before layer ``layer``'s slot compute: wait until its slots are filled, consume the mark.

        On CPU the wait polls and, if the publisher dies meanwhile, calls ``rescue(layer)`` (which
        fills the slots and sets FULL) and goes on. On a GPU the wait is enqueued on the stream; the
        worker's watchdog rescues a stalled GPU (:meth:`stalled_layer`).
        """
        start = time.perf_counter()
        while True:
            try:
                acquire(self.ops, self.stream, self.buffers.flags, layer)
                break
            except FlagWaitInterrupted:
                if rescue is None:
                    raise
                rescue(layer)
        if self.stream is None:  # on a GPU the wait is only enqueued: nothing to time here
            self.layer_wait_s += time.perf_counter() - start
        self._write_progress(STARTED, layer + 1)

    def release(self, layer: int) -> None:
        """After layer ``layer``'s slot compute (enqueued on the stream): its slots are free again."""
        release(self.ops, self.stream, self.buffers.flags, layer)
        self._write_progress(DONE, layer + 1)

    def finish(self, iteration: int) -> None:
        """Every layer of ``iteration`` has run (on a GPU: call it once the device got there)."""
        with self.shared.locks.hold(self.worker):
            if int(self._state[FINISHED]) < iteration:
                self._state[FINISHED] = iteration
        ring(self.shared.to_coordinator[self.worker])

    def _write_progress(self, which: int, value: int) -> None:
        self.ops.write(self.stream, self.buffers.progress, 0, which, value)

    def stalled_layer(self, read: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
        """The layer a GPU waits on for a FULL flag that is not set, or None: the previous layer's
        slot compute is done (no slot is being read) and this one has not consumed its flag.
        ``read`` copies a device tensor to the host without waiting for the compute stream."""
        progress, flags = read(self.buffers.progress).tolist()[0], read(self.buffers.flags)
        started, done = progress[STARTED], progress[DONE]
        if started == done and started < self.num_layers and int(flags[started, FULL]) == 0:
            return int(started)
        return None

    def stop_requested(self, iteration: int) -> bool:
        """Whether the node asked to stop before ``iteration`` (out of band of the headers)."""
        stop_at = int(self.shared.stop_at[0])
        return 0 <= stop_at <= iteration

    def wait_for_coordinator(self, timeout_s: float) -> bool:
        """At start: wait until the first coordinator attached (or died), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while int(self.shared.coordinator[0]) < 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._bell.acquire(True, min(remaining, 0.1))
        return True

    def slot(self, slot: int) -> torch.Tensor:
        """Packed weights [D] in ``slot``."""
        return self.buffers.slots[slot]

    def set_tag(self, slot: int, layer: int, expert: int) -> None:
        tags = self.shared.tags[self.worker]
        tags[slot, LAYER], tags[slot, EXPERT] = layer, expert

    def check_tags(self, iteration: int, table: RoutingTable, layer: int, rank: int) -> None:
        """Raise if a slot this rank will compute with was not filled with the expert the plan names."""
        tags = self.shared.tags[self.worker]
        for slot, expert in enumerate(table.slot_expert[layer, rank].tolist()):
            if expert >= 0 and tags[slot].tolist() != [layer, expert]:
                raise RuntimeError(
                    f"slot {slot} in iteration {iteration} holds {tags[slot].tolist()}, plan {table.plan_id} "
                    f"names layer {layer} expert {expert}: protocol violated"
                )


@dataclass(frozen=True)
class Agreement:
    """The workers' common view of one iteration: run with the announced plan's slots, or degraded."""

    use_plan: bool
    plan_id: int
    k: int
    stop: bool
    all_published: bool = True  # every rank had the iteration published (none claimed it)


def agree(
    ready: bool,
    header: Header | None,
    digest: int,
    world: int,
    group: dist.ProcessGroup | None,
    stop: bool = False,
) -> Agreement:
    """All ranks exchange (ready, header, table digest) and derive the same decision.

    ``digest`` is :meth:`RoutingTable.digest` of the announced plan's table (−1 without a header).
    The plan is used only if every rank is ready and all hold the *same table* (equal digests: with
    several nodes each coordinator makes its own plans, and a rank must never route to a slot by a
    table its owner's coordinator did not fill by); ``k`` is the largest announced (0 = none) and
    ``stop`` is set if any rank saw a stop request (in its header or out of band: ``stop``).
    """
    stopping = stop or bool(header and header.stop)
    mine = [int(ready), header.plan_id if header else -1, digest, header.k if header else 0, int(stopping)]
    if group is None or world == 1:  # plain ints: this runs every iteration, torch ops cost µs each
        return decide([mine])
    everyone = torch.empty(world * len(mine), dtype=torch.int64)
    dist.all_to_all_single(everyone, torch.tensor(mine, dtype=torch.int64).repeat(world), group=group)
    return decide(everyone.view(world, -1))


def decide(everyone: torch.Tensor | list[list[int]]) -> Agreement:
    """The common decision from every rank's (ready, plan id or −1, digest or −1, k or 0, stop): [N, 5]."""
    rows = everyone.tolist() if isinstance(everyone, torch.Tensor) else everyone
    digests = [row[2] for row in rows]
    ready_all = min(row[0] for row in rows) == 1
    same = min(digests) == max(digests) and min(digests) >= 0
    return Agreement(
        all_published=ready_all,
        use_plan=ready_all and same,
        plan_id=int(max(row[1] for row in rows)),
        k=int(max(row[3] for row in rows)),
        stop=max(row[4] for row in rows) > 0,
    )


# ---------------------------------------------------------------------------------------------
# Coordinator side
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assignment:
    """A routing table and the pool snapshot its slots are filled from."""

    table: RoutingTable
    pool: ExpertPool


@dataclass
class FillStats:
    """Running totals of the fill loop (read by the node for metrics)."""

    bytes_streamed: int = 0
    copies: int = 0
    fills: int = 0
    release_wait_s: float = 0.0
    copy_s: float = 0.0  # time the copies took (GPU: CUDA events on the copy streams, flag waits excluded)
    last_iteration: int = -1


class FillAborted(Exception):
    """The fill loop was asked to stop while waiting."""


class SlotFiller:
    """Publishes iterations and fills each layer's slots into every local worker's buffers."""

    def __init__(
        self,
        shared: SharedState,
        buffers: list[SlotBuffers],
        ranks: list[int],
        transport: SlotTransport,
        num_layers: int,
        abort: threading.Event,
        generation: int,
        stats: FillStats | None = None,
        resume_iteration: int = 0,
    ) -> None:
        self.shared = shared
        self.buffers = buffers
        self.ranks = ranks  # EP rank of each local worker
        self.transport = transport
        self.num_layers = num_layers
        self.abort = abort
        self.generation = generation
        # Iterations before this one may have been published by a predecessor and be half filled:
        # the workers rescue them and may still read any slot, whatever its FREE flag says.
        self.resume_iteration = resume_iteration
        self.stats = stats if stats is not None else FillStats()  # running totals survive a restart
        self.ops = transport.flag_ops(abort.is_set)
        self.ahead = min(transport.publish_ahead, AHEAD)  # iterations published past the last finished
        # Per worker and slot the layer whose fill wrote it last; None: unknown (a predecessor's),
        # so the first fill of each worker waits for every layer's FREE flag.
        self._last_layer: list[list[int] | None] = [None for _ in ranks]
        self._events: list[tuple[Any, Any]] = []  # GPU: (start, end) CUDA events of fills in flight
        self._written: list[set[int]] = [set() for _ in ranks]  # slots whose tag this filler wrote (trusted)
        # numpy views of each worker's tags (the shared memory itself): a tensor element costs ~4 µs
        # to read or write, and every fill checks or writes two per slot
        self._tags = [shared.tags[worker].numpy() for worker in range(len(ranks))]
        self._copy_start: Any = None
        self._claimed = [-1 for _ in ranks]  # per worker, the last iteration its publish found claimed

    def _wait_finished(self, worker: int, until: int) -> bool:
        state, bell = self.shared.state[worker], self.shared.to_coordinator[worker]
        start = time.perf_counter()
        while True:
            with self.shared.locks.hold(worker):
                finished = int(state[FINISHED])
            if finished >= until:
                break
            if self.abort.is_set():
                return False
            bell.acquire(True, 0.1)
        self.stats.release_wait_s += time.perf_counter() - start
        return True

    def publish(self, iteration: int, plan_id: int, k: int, stop: bool) -> list[bool] | None:
        """Announce ``iteration`` to every worker that has not claimed it; per worker whether its
        layers must now be filled (None: aborted)."""
        filling = []
        for worker in range(len(self.ranks)):
            until = max(iteration - self.ahead, self.resume_iteration - 1)
            if self._claimed[worker] == iteration - 1:
                # The worker claimed iteration − 1 and set its FULL flags itself, while its FREE flags
                # still say free: a fill of this iteration now would set FULL flags already set —
                # consumed by iteration − 1, lost to this one (the worker would wait for them forever)
                # — and copy into slots iteration − 1 may still read. So this one waits until the
                # worker finished that one. (A new coordinator's first publish waits for
                # resume_iteration − 1 already.)
                until = max(until, iteration - 1)
            if not self._wait_finished(worker, until):
                return None
            with self.shared.locks.hold(worker):
                state = self.shared.state[worker]
                claimed = int(state[SKIPPED]) >= iteration
                if claimed:
                    self._claimed[worker] = iteration
                else:
                    header = self.shared.headers[worker, iteration % HEADERS]
                    header[ITERATION], header[PLAN_ID], header[K_VALUE] = iteration, plan_id, k
                    header[STOP], header[GENERATION] = int(stop), self.generation
                    state[PUBLISHED] = iteration
            filling.append(not claimed and not stop)
            ring(self.shared.to_worker[worker])
        self.stats.last_iteration = iteration
        return filling

    def fill_layer(self, iteration: int, layer: int, assignment: Assignment, filling: list[bool]) -> None:
        """Enqueue (GPU) or perform (CPU) the fill of ``layer`` of ``iteration`` for every worker in
        ``filling``: wait until the slots it overwrites are free, copy the planned experts whose slot
        does not hold them yet, mark the layer FULL."""
        table, pool = assignment.table, assignment.pool
        for worker, rank in enumerate(self.ranks):
            if not filling[worker]:
                continue
            buffers = self.buffers[worker]
            stream = self.transport.stream(buffers)
            wanted = table.slot_expert[layer, rank].tolist()
            used = [slot for slot, expert in enumerate(wanted) if expert >= 0]
            last = self._last_layer[worker]
            if last is None:
                before = [j for j in range(self.num_layers) if j != layer]
                last = self._last_layer[worker] = [-1] * buffers.slots.shape[0]
            else:
                before = sorted({last[slot] for slot in used} - {-1, layer})
            try:
                for j in before:  # slots still read by another layer: wait, without claiming its flag
                    self.ops.wait_eq(stream, buffers.flags, j, FREE, 1)
            except FlagWaitInterrupted:
                raise FillAborted from None
            copy_in = functools.partial(self._copy_layer, worker, layer, wanted, used, pool)
            self._copy_start = None
            try:
                produce(self.ops, stream, buffers.flags, layer, copy_in)
            except FlagWaitInterrupted:
                raise FillAborted from None
            if self._copy_start is not None:  # something was copied: time it
                self._done(stream, self._copy_start)
            elif self._events:
                self._harvest()
        self.stats.fills += 1

    def _copy_layer(self, worker: int, layer: int, wanted: list[int], used: list[int], pool: ExpertPool) -> None:
        """Copy ``layer``'s planned experts (``wanted`` per slot, ``used`` slots) into ``worker``'s
        slots, skipping a slot this filler already filled with the same expert."""
        buffers, tags, last = self.buffers[worker], self._tags[worker], self._last_layer[worker]
        assert last is not None
        # copy time from the first copy on (fill_layer reset it); a fill whose slots all hold their
        # experts already (every layer of every iteration while the plan stands) makes no timing
        # events (two per fill: at 58 layers × 8 workers ~900 an iteration)
        row_bytes = buffers.slots.element_size() * buffers.slots.shape[-1]
        for slot in used:
            expert = wanted[slot]
            last[slot] = layer
            if slot in self._written[worker] and tags[slot, LAYER] == layer and tags[slot, EXPERT] == expert:
                continue  # still holds it; a predecessor's tags are not trusted (its copy may not have landed)
            if self._copy_start is None:
                self._copy_start = self._mark(self.transport.stream(buffers))
            # the tag says "empty" while the copy is in flight: a fill that fails half way leaves a
            # slot no later fill will take for a complete copy
            tags[slot, LAYER] = -1
            tags[slot, EXPERT] = -1
            self.copy(buffers.slots[slot], pool.row(layer, expert))
            tags[slot, LAYER] = layer
            tags[slot, EXPERT] = expert
            self._written[worker].add(slot)
            self.stats.bytes_streamed += row_bytes
            self.stats.copies += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue the copy of one packed expert row into a slot."""
        self.transport.copy(dst, src)

    def _mark(self, stream: Any) -> Any:
        if stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _done(self, stream: Any, start: Any) -> None:
        if stream is None:
            self.stats.copy_s += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._events.append((start, end))
        self._harvest()

    def _harvest(self) -> None:
        """Add the time of the GPU fills that have run to the copy time."""
        while self._events and self._events[0][1].query():
            first, last = self._events.pop(0)
            self.stats.copy_s += first.elapsed_time(last) / 1000.0


class FillLoop(threading.Thread):
    """The coordinator's fill pipeline: publishes each iteration (with the plan it takes at the
    iteration boundary) and fills its layers, publishing at most ``filler.ahead`` iterations past the
    last one every worker finished.

    ``take_plan(iteration)`` returns the assignment for an iteration; ``control(iteration)`` returns
    (k, stop). Any exception ends the loop with :attr:`error` set: the coordinator then exits, and
    the workers rescue the layers it left unfilled.
    """

    def __init__(
        self,
        filler: SlotFiller,
        take_plan: Callable[[int], Assignment],
        control: Callable[[int], tuple[int, bool]],
        start_iteration: int = 0,
    ) -> None:
        super().__init__(name="vexpert-fill", daemon=True)
        self.filler = filler
        self.take_plan = take_plan
        self.control = control
        self.start_iteration = start_iteration
        self.error: BaseException | None = None

    def run(self) -> None:
        filler = self.filler
        iteration = self.start_iteration
        try:
            while not filler.abort.is_set():
                assignment = self.take_plan(iteration)
                k, stop = self.control(iteration)
                filling = filler.publish(iteration, assignment.table.plan_id, k, stop)
                if filling is None or stop:
                    return
                for layer in range(filler.num_layers):
                    filler.fill_layer(iteration, layer, assignment, filling)
                iteration += 1
        except FillAborted:
            return
        except BaseException as exc:  # surfaced by the coordinator, which exits: the workers rescue
            self.error = exc
