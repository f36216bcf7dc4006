"""Coordinator–worker slot-fill protocol (one module; the copy mechanism is a :class:`SlotTransport`).

Each worker owns **one** slot buffer of ``S = G·vmax`` expert slots (the paper's L1 memory). The
unit of the protocol is one MoE layer of one iteration, the *layer sequence* ``q = t·L + l``; the
coordinator fills ``q`` while the worker computes ``q − 1`` (layer-ahead streaming). The allocator lays
adjacent layers out on disjoint slots (even layers from slot 0 up, odd layers from slot S − 1 down, with
``V_l + V_{l+1} ≤ S``), so that overlap never waits; when two adjacent layers' slots do overlap (a plan
switch, a scripted plan) the fill simply waits until the earlier layer is released.

Per worker a small shared-memory record holds::

    FILLED   – last layer sequence whose slots are complete (coordinator writes)
    RELEASED – last layer sequence whose compute no longer reads any slot (worker writes)

plus a ring of ``HEADERS`` headers (``HDR_SEQ, PLAN_ID, K, STOP``: which plan — routing table — the layer
runs under, the allocation interval k, and whether to stop) indexed by ``q mod HEADERS``, and a tag per
slot, ``(layer, expert)`` it holds. The rules:

* the coordinator fills ``q`` only after ``RELEASED ≥ q − 2`` (at most one layer ahead of the one being
  computed, which also keeps the header ring safe) and ``RELEASED ≥`` the last sequence that used any
  slot it is about to write (never overwrites a slot still in use); it writes the header, copies the
  slots whose tag differs, waits until the copies have landed (on a GPU: synchronizes its copy
  stream), then sets ``FILLED = q``;
* a worker starts layer ``q`` only after ``FILLED ≥ q`` (never reads stale slots) and checks the tags
  against its plan; after the layer's expert compute has completed (on a GPU: its stream is
  synchronized) it sets ``RELEASED = q``;
* every read or write of a worker's record happens under that worker's mutex (also the memory
  fence), and waits sleep on a doorbell semaphore the other side rings after its write. Both survive
  the death of either side, so the coordinator can be a separate process that is SIGKILLed and
  restarted while the workers keep running (:mod:`vexpert_runtime.node.coordinator`): the mutex is a
  POSIX record lock on one byte of an anonymous ``memfd`` (the kernel drops a dead process's locks;
  a ``multiprocessing.Lock`` held by a killed process would stay held forever, and a
  ``multiprocessing.Condition``'s notify blocks until every sleeper, dead or not, wakes), and a
  doorbell is a plain semaphore (no owner, a dead poster or sleeper leaves nothing blocked);
* a worker waiting longer than ``slot_fill_timeout_s`` runs the layer on the static placement
  (degraded) instead of hanging, and while no coordinator is attached (``SharedState.coordinator``
  0, set by the node when the coordinator process dies) it does not wait at all;
* a new coordinator resumes at :meth:`SharedState.resume_seq`, after the last sequence any worker
  filled or released, and treats every slot as in use until the workers released everything filled
  before it (it does not know its predecessor's layout); it trusts no tag it did not write itself (a
  copy in flight when its predecessor died may have been tagged already on a GPU, where copies are
  asynchronous), so its first fill of each slot is a full copy;
* a new plan is taken by the fill loop at an iteration boundary (layer 0): workers never wait for
  the allocator, and all layers of one iteration use one plan;
* a slot's tag is set to empty before its copy is enqueued and to ``(layer, expert)`` only after: a
  fill that fails half way leaves its sequence unfilled (the workers time out and run that layer
  degraded) and no tag that would let a later fill skip re-copying a half-written slot.

Workers agree on every layer's header with one tiny collective (:func:`agree`), so a worker that
timed out, or a node whose coordinator adopted a different plan (another table), makes the whole
layer run degraded rather than mixing plans.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vexpert_runtime.model.ep_moe import RoutingTable
from vexpert_runtime.node.expert_pool import ExpertPool
from vexpert_runtime.node.transport import SlotTransport

FILLED, RELEASED = 0, 1
NUM_FIELDS = 2
HDR_SEQ, PLAN_ID, K_VALUE, STOP = range(4)
HEADER_FIELDS = 4
HEADERS = 4  # header ring: the coordinator is at most 2 sequences ahead of the last release
LAYER, EXPERT = 0, 1
AHEAD = 2  # fill q once RELEASED ≥ q − AHEAD: q − 1 may still be computing, q − 2 is done


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
    """The protocol's shared memory, created by the node and passed to workers (and to every
    coordinator process) at spawn.

    state: [W, NUM_FIELDS] int64 (FILLED, RELEASED); headers: [W, HEADERS, HEADER_FIELDS] int64;
    tags: [W, S, 2] int64 ((layer, expert) per slot, −1 empty); locks: one robust mutex per local
    worker; to_worker / to_coordinator: one doorbell semaphore per local worker and direction;
    coordinator: [1] int64, −1 until the first coordinator attached (workers wait for it before their
    first iteration), 1 while one is attached or restarting, 0 while none is (workers then run
    degraded at once instead of waiting).
    """

    state: torch.Tensor
    headers: torch.Tensor
    tags: torch.Tensor
    locks: RobustLocks
    to_worker: list[Any]
    to_coordinator: list[Any]
    stop_at: torch.Tensor  # [1] int64: first iteration not to run (−1 = none); see :meth:`request_stop`
    coordinator: torch.Tensor

    @classmethod
    def create(cls, workers: int, slots: int, ctx: Any) -> SharedState:
        state = torch.full((workers, NUM_FIELDS), -1, dtype=torch.int64)
        headers = torch.full((workers, HEADERS, HEADER_FIELDS), -1, dtype=torch.int64)
        tags = torch.full((workers, max(slots, 1), 2), -1, dtype=torch.int64)
        stop_at = torch.full((1,), -1, dtype=torch.int64)
        coordinator = torch.full((1,), -1, dtype=torch.int64)
        return cls(
            state.share_memory_(),
            headers.share_memory_(),
            tags.share_memory_(),
            RobustLocks(workers),
            [ctx.Semaphore(0) for _ in range(workers)],
            [ctx.Semaphore(0) for _ in range(workers)],
            stop_at.share_memory_(),
            coordinator.share_memory_(),
        )

    @property
    def workers(self) -> int:
        return int(self.state.shape[0])

    def request_stop(self, iteration: int) -> None:
        """Ask workers to stop before ``iteration`` even if the fill pipeline is behind (a worker that
        timed out never sees the stop header); they agree on it at their next iteration start."""
        current = int(self.stop_at[0])
        self.stop_at[0] = iteration if current < 0 else min(current, iteration)

    def set_coordinator(self, attached: bool) -> None:
        """Mark the coordinator attached (or starting) or gone; waiting workers are woken."""
        self.coordinator[0] = int(attached)
        for bell in self.to_worker:
            ring(bell)

    def coordinator_attached(self) -> bool:
        return int(self.coordinator[0]) != 0

    def announced_plan(self, seq: int) -> int | None:
        """The plan id in the header of sequence ``seq``, if a worker's record still holds it."""
        if seq < 0:
            return None
        for worker in range(self.workers):
            with self.locks.hold(worker):
                row = self.headers[worker, seq % HEADERS]
                if int(row[HDR_SEQ]) == seq:
                    return int(row[PLAN_ID])
        return None

    def resume_seq(self) -> int:
        """The first sequence a (new) coordinator may fill: after every sequence any worker has seen
        filled or has released."""
        last = -1
        for worker in range(self.workers):
            with self.locks.hold(worker):
                last = max(last, int(self.state[worker].max()))
        return last + 1


@dataclass(frozen=True)
class Header:
    """What the coordinator announces for one layer sequence."""

    seq: int
    plan_id: int
    k: int
    stop: bool


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


class WorkerSlots:
    """A worker's view of its slot buffer ``[S, D]`` and its protocol record."""

    def __init__(self, shared: SharedState, worker: int, buffers: torch.Tensor, timeout_s: float) -> None:
        self.shared = shared
        self.worker = worker
        self.buffers = buffers  # [S, D]
        self.timeout_s = timeout_s
        self._bell = shared.to_worker[worker]
        self._state = shared.state[worker]
        self._headers = shared.headers[worker]

    def acquire(self, seq: int) -> tuple[bool, Header | None, float]:
        """Wait until sequence ``seq``'s slots are filled (or the timeout passes).

        Returns (ready, header or None if not even the header arrived, seconds waited). Does not wait
        while no coordinator is attached.
        """
        start = time.perf_counter()
        deadline = start + self.timeout_s
        locks = self.shared.locks
        while True:
            with locks.hold(self.worker):
                filled = int(self._state[FILLED])
                row = self._headers[seq % HEADERS].tolist()
            ready = filled >= seq
            remaining = deadline - time.perf_counter()
            if ready or remaining <= 0 or not self.shared.coordinator_attached():
                break
            self._bell.acquire(True, min(remaining, 0.1))
        waited = time.perf_counter() - start
        header = None
        if row[HDR_SEQ] == seq:
            header = Header(seq, row[PLAN_ID], row[K_VALUE], bool(row[STOP]))
        return ready, header, waited

    def stop_requested(self, iteration: int) -> bool:
        """Whether the coordinator asked to stop before ``iteration`` (out of band of the headers)."""
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

    def release(self, seq: int) -> None:
        """This worker no longer reads the slots of sequence ``seq`` (nor of any earlier one).

        On a GPU the compute that reads the slots was only enqueued: the worker's stream is
        synchronized first, so the coordinator cannot overwrite a slot a GEMM still reads.
        """
        if self.buffers.is_cuda:
            torch.cuda.current_stream(self.buffers.device).synchronize()
        with self.shared.locks.hold(self.worker):
            if int(self._state[RELEASED]) < seq:
                self._state[RELEASED] = seq
        ring(self.shared.to_coordinator[self.worker])

    def slot(self, slot: int) -> torch.Tensor:
        """Packed weights [D] in ``slot``."""
        return self.buffers[slot]

    def check_tags(self, seq: int, table: RoutingTable, layer: int, rank: int) -> None:
        """Raise if a slot this rank will compute with does not hold the expert the plan names."""
        tags = self.shared.tags[self.worker]
        for slot, expert in enumerate(table.slot_expert[layer, rank].tolist()):
            if expert >= 0 and tags[slot].tolist() != [layer, expert]:
                raise RuntimeError(
                    f"slot {slot} of sequence {seq} holds {tags[slot].tolist()}, plan {table.plan_id} "
                    f"names layer {layer} expert {expert}: protocol violated"
                )


@dataclass(frozen=True)
class Agreement:
    """The workers' common view of one group: run with the announced plan's slots, or degraded."""

    use_plan: bool
    plan_id: int
    k: int
    stop: bool


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
    mine = torch.tensor(
        [int(ready), header.plan_id if header else -1, digest, header.k if header else 0, int(stopping)],
        dtype=torch.int64,
    )
    if group is None or world == 1:
        everyone = mine.view(1, -1)
    else:
        everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
        dist.all_to_all_single(everyone, mine.repeat(world), group=group)
        everyone = everyone.view(world, -1)
    return decide(everyone)


def decide(everyone: torch.Tensor) -> Agreement:
    """The common decision from every rank's (ready, plan id or −1, digest or −1, k or 0, stop): [N, 5]."""
    ready_all = bool(everyone[:, 0].min() == 1)
    digests = everyone[:, 2]
    same = bool(digests.min() == digests.max()) and int(digests.min()) >= 0
    return Agreement(
        use_plan=ready_all and same,
        plan_id=int(everyone[:, 1].max()),
        k=int(everyone[:, 3].max()),
        stop=bool(everyone[:, 4].max() > 0),
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
    copy_s: float = 0.0  # from a fill's first copy enqueued until all its copies landed
    last_seq: int = -1
    plan_switches: list[tuple[int, int]] = field(default_factory=list)  # (iteration, plan id)


class SlotFillError(RuntimeError):
    """One sequence's fill failed; its layer runs on the static placement."""


class SlotFiller:
    """Writes one layer sequence's slots into every local worker's buffer."""

    def __init__(
        self,
        shared: SharedState,
        buffers: list[torch.Tensor],
        ranks: list[int],
        transport: SlotTransport,
        num_layers: int,
        abort: threading.Event,
        resume_seq: int = 0,
        stats: FillStats | None = None,
    ) -> None:
        self.shared = shared
        self.buffers = buffers  # per local worker [S, D]
        self.ranks = ranks  # EP rank of each local worker
        self.transport = transport
        self.num_layers = num_layers
        self.abort = abort
        self.stats = stats if stats is not None else FillStats()  # running totals survive a loop restart
        self._written: set[tuple[int, int]] = set()  # (worker, slot) this filler copied
        # Per worker and slot the last sequence that may read it. A new filler does not know what
        # its predecessor filled: everything before ``resume_seq`` counts as possibly in use.
        slots = buffers[0].shape[0] if buffers else 0
        self._last_use = [[resume_seq - 1] * slots for _ in ranks]

    def _wait_released(self, worker: int, until: int) -> bool:
        """Wait until the worker released sequence ``until``; False if aborted."""
        state, bell = self.shared.state[worker], self.shared.to_coordinator[worker]
        start = time.perf_counter()
        while True:
            with self.shared.locks.hold(worker):
                released = int(state[RELEASED])
            if released >= until:
                break
            if self.abort.is_set():
                return False
            bell.acquire(True, 0.1)
        self.stats.release_wait_s += time.perf_counter() - start
        return True

    def fill(self, seq: int, assignment: Assignment, k: int, stop: bool) -> bool:
        """Fill sequence ``seq`` for every worker; False if aborted.

        First every worker's header is written and its copies are enqueued (on GPUs they run
        concurrently, one copy stream per GPU), then per worker the copies are waited for
        (:meth:`SlotTransport.flush`) before ``FILLED`` is bumped: a worker never sees "filled" while
        a copy into its buffer is still in flight.
        """
        layer = seq % self.num_layers
        table, pool = assignment.table, assignment.pool
        elem = self.buffers[0].element_size() * self.buffers[0].shape[-1] if self.buffers else 0
        first_copy: float | None = None
        copies_here = 0
        for worker, rank in enumerate(self.ranks):
            wanted = table.slot_expert[layer, rank].tolist() if not stop else []
            used = [slot for slot, expert in enumerate(wanted) if expert >= 0]
            last_use = self._last_use[worker]
            busy = max([last_use[slot] for slot in used], default=-1)
            if not self._wait_released(worker, max(seq - AHEAD, busy)):
                return False
            with self.shared.locks.hold(worker):
                header = self.shared.headers[worker, seq % HEADERS]
                header[HDR_SEQ], header[PLAN_ID], header[K_VALUE], header[STOP] = seq, table.plan_id, k, int(stop)
                behind = int(self.shared.state[worker, RELEASED]) >= seq  # the worker gave up waiting and moved on
            tags = self.shared.tags[worker]
            if stop or behind:
                continue
            for slot in used:
                expert = wanted[slot]
                last_use[slot] = seq
                trusted = (worker, slot) in self._written  # a predecessor's tags are not
                if trusted and tags[slot].tolist() == [layer, expert]:
                    continue
                if first_copy is None:
                    first_copy = time.perf_counter()
                # the tag says "empty" while the copy is in flight: a fill that fails half way
                # leaves a slot no later fill will take for a complete copy
                tags[slot, LAYER], tags[slot, EXPERT] = -1, -1
                self.copy(seq, copies_here, self.buffers[worker][slot], pool.row(layer, expert))
                tags[slot, LAYER], tags[slot, EXPERT] = layer, expert
                self._written.add((worker, slot))
                self.stats.bytes_streamed += elem
                self.stats.copies += 1
                copies_here += 1
        for worker in range(len(self.ranks)):
            self.transport.flush(self.buffers[worker])
            with self.shared.locks.hold(worker):
                self.shared.state[worker, FILLED] = seq
            ring(self.shared.to_worker[worker])
        if first_copy is not None:
            self.stats.copy_s += time.perf_counter() - first_copy
        self.stats.fills += 1
        self.stats.last_seq = seq
        return True

    def copy(self, seq: int, index: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue the ``index``-th copy of sequence ``seq`` (one packed expert row)."""
        self.transport.copy(dst, src)


class FillLoop(threading.Thread):
    """The coordinator's fill pipeline: runs ahead of the workers by one layer, picking up a new plan
    at each iteration boundary.

    ``take_plan(iteration, prefer)`` returns the assignment for an iteration (the node's latest
    plan, or plan id ``prefer`` if it still has it); ``control(iteration)`` returns (k, stop).
    A fill that raises an ``Exception`` leaves its sequence unfilled (that layer runs degraded);
    anything else ends the loop with :attr:`error` set (the coordinator restarts it).

    A loop (re)started mid-iteration (``start_layer`` > 0) finishes that iteration under the plan
    its earlier layers announced (``resume_plan``) when it still has it, and takes a stop only at
    the next iteration boundary: the workers are inside the iteration and a stop header for a later
    layer would leave the next iteration's first layer unfilled until their slot wait times out.
    """

    def __init__(
        self,
        filler: SlotFiller,
        take_plan: Callable[[int, int | None], Assignment],
        control: Callable[[int], tuple[int, bool]],
        start_iteration: int = 0,
        on_failure: Callable[[int, BaseException], None] | None = None,
        start_layer: int = 0,
        resume_plan: int | None = None,
    ) -> None:
        super().__init__(name="vexpert-fill", daemon=True)
        self.filler = filler
        self.take_plan = take_plan
        self.control = control
        self.start_iteration = start_iteration
        self.start_layer = start_layer  # a coordinator that re-attaches mid-iteration starts there
        self.resume_plan = resume_plan  # the plan the start iteration's earlier layers ran under
        self.on_failure = on_failure
        self.failures = 0  # sequences whose fill failed (left unfilled: their layer runs degraded)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            iteration, first = self.start_iteration, self.start_layer
            num_layers = self.filler.num_layers
            while not self.filler.abort.is_set():
                assignment = self.take_plan(iteration, self.resume_plan if first else None)
                k, stop = self.control(iteration)
                stop = stop and first == 0
                for layer in range(first, first + 1 if stop else num_layers):
                    seq = iteration * num_layers + layer
                    try:
                        if not self.filler.fill(seq, assignment, k, stop):
                            return
                    except Exception as exc:  # FILLED is not bumped: the workers time out and run degraded
                        self.failures += 1
                        if self.on_failure is not None:
                            self.on_failure(seq, exc)
                if stop:
                    return
                iteration, first = iteration + 1, 0
        except BaseException as exc:  # surfaced by the node, which keeps serving and restarts the loop
            self.error = exc
