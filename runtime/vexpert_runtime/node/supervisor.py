"""One vExpert node: a supervisor (this process), a coordinator process and one worker process per
GPU (or CPU worker).

* The **supervisor** (:class:`NodeRuntime`) owns the shared protocol state, the workers and their
  queues; it runs the allocator every ``k`` iterations on the all-reduced expert counts, serves the
  node's metrics, re-reads the config file's ``tuning`` section when it changes, verifies outputs
  against the single-process reference on request, and shuts everything down cleanly.
* The **coordinator** (:mod:`~vexpert_runtime.node.coordinator`, a child process) owns the L2 expert pool
  and fills the workers' L1 slots through the :mod:`~vexpert_runtime.node.protocol` fill loop (a thread
  running one group ahead of the workers) with the supervisor's latest plan.
* Each **worker** is one EP rank: it holds its base experts, routes its tokens, and runs the EP MoE
  forward (:mod:`~vexpert_runtime.model.ep_moe`) with the other workers over torch.distributed, computing
  with the slots the coordinator filled. On CPU everything goes over gloo; on GPUs (one worker per
  GPU, ``cuda:<local rank>``) the rows and counts are all-to-all'd over NCCL on device tensors and the
  tiny control collectives (plan agreement, count windows) over gloo, through one process group with
  the ``cpu:gloo,cuda:nccl`` backend. The code path is the same; only the device differs.

If the coordinator process dies (or only its fill loop), the workers keep serving on their base
experts (``vexpert_degraded`` 1; they do not even wait while the shared state says no coordinator is
attached) and it is restarted with backoff; the new one re-opens the workers' exported slot buffers
and resumes at the sequence the workers reached. Workers and coordinator die with the supervisor
(``PR_SET_PDEATHSIG``) and everything is terminated on any worker error (the node exits 1 naming the
worker that died), so no process outlives a node; CPU slots are torch shared-memory tensors whose
/dev/shm files are unlinked at creation, so none can leak. GPU slots live in each worker's HBM and
are mapped by the coordinator through CUDA IPC (the supervisor passes the handles on unopened); at
shutdown the coordinator exits, dropping its mappings, before the workers are told to exit.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from vexpert_runtime.config import TuningConfig, load_runtime_config
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import (
    CheckpointReader,
)
from vexpert_runtime.model.dispatch import DISPATCH_MODES
from vexpert_runtime.model.ep_moe import (
    RoutingTable,
    static_table,
    table_from_plan,
)
from vexpert_runtime.model.moe_math import relative_error
from vexpert_runtime.model.reference import ModelWeights, reference_forward
from vexpert_runtime.node.coordinator import CoordinatorArgs, coordinator_main
from vexpert_runtime.node.expert_pool import hottest_experts
from vexpert_runtime.node.messages import (
    Attached,
    Bye,
    CoordinatorFailed,
    CountsWindow,
    Exit,
    FillLoopDied,
    FillTotals,
    Heartbeat,
    IterationDone,
    NewPlan,
    PlanSwitched,
    SetInterval,
    SlotsExported,
    WorkerDone,
    WorkerFailed,
    WorkerInputError,
    WorkerReady,
)
from vexpert_runtime.node.metrics import BalanceDecay, NodeMetrics, PoolHits, memory_pressure
from vexpert_runtime.node.protocol import SharedState
from vexpert_runtime.node.report import IterationRecord, NodeOptions, NodeReport, Progress
from vexpert_runtime.node.setup import (
    NodeSetup,
    check_memory,
    check_pooled,
    memory_plan,
    rendezvous_url,
    single_node_environment,
)
from vexpert_runtime.node.worker import COLLECTIVE_TIMEOUT_S, STARTUP_TIMEOUT_S, worker_main
from vexpert_runtime.node.worker_args import WorkerArgs
from vexpert_runtime.policy.allocator import AllocatorConfig, DeviceAllocator, Plan, allocate
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, static_placement

RATE_HORIZON_S = 2.0  # tokens/s gauge: averaged over at least this much recent time


# ---------------------------------------------------------------------------------------------
# Coordinator
# ---------------------------------------------------------------------------------------------


class NodeRuntime:
    """Runs one node until ``options.iterations`` or :meth:`request_stop`."""

    def __init__(self, setup: NodeSetup, options: NodeOptions | None = None) -> None:
        self.setup = setup
        self.options = options or NodeOptions()
        spec = setup.spec
        self.metrics = NodeMetrics(spec.num_layers)
        self.abort = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._k = setup.k
        self._pooled = setup.pooled
        self._base_gpu = static_placement(spec.num_layers, spec.num_experts, setup.world)
        self._hotness = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64)
        self._plan_id = 0
        self._records: dict[int, IterationRecord] = {}
        self._allocator_s: list[float] = []
        self._graphed_steps = 0
        self._switches: list[tuple[int, int]] = []
        self._last_plan = -1
        self._max_error: float | None = None
        self._bytes_reported = 0
        self._vexperts = [0] * spec.num_layers
        self._config_mtime: int | None = None
        self._last_reload_check = 0.0
        self._reference: ModelWeights | None = None
        self._reader = CheckpointReader(setup.checkpoint, spec)
        self._scripted: dict[int, tuple[RoutingTable, torch.Tensor]] = {}  # iteration → (table, pooled experts)
        self._assignment: tuple[RoutingTable, torch.Tensor] | None = None  # the latest plan
        self._pool_experts = hottest_experts(self._hotness, self._pooled)  # [L, Np]: what the coordinator pools
        self._handles: dict[int, Any] = {}  # local worker → its exported slot buffers
        self._coordinator: Any = None  # the coordinator process
        self._conn: Any = None  # the node's end of its pipe
        self._coordinator_attached = False
        self._coordinator_starts = 0
        self._coordinator_restarts = 0
        self._coordinator_restart_at: float | None = None
        self._coordinator_down_since: float | None = None
        self._fill_loop_down = False
        self._sent_k = self._k
        self._streamed_done = self._streamed_now = 0  # bytes streamed by dead / the running coordinator
        self._copy_s_done = self._copy_s_now = 0.0
        self._started_at: float | None = None
        self._last_iter_at: float | None = None
        self._window_clock: float | None = None  # when the first iteration started
        self._rate_marks: collections.deque[tuple[float, int]] = collections.deque()  # (time, iterations)
        self._metrics_port: int | None = None
        self._degraded_total = 0
        self._pending_verify: list[tuple[int, int, np.ndarray]] = []
        self._shared: SharedState | None = None
        self._windows: list[tuple[int, int]] = []
        self._tables: dict[int, RoutingTable] = {}
        self._plan_pools: dict[int, list[list[int]]] = {}
        self._ready = self._done = 0
        self._completed = 0  # iterations every local worker finished
        self._pool_loaded = False
        self._decay = BalanceDecay()
        self._hits = PoolHits()
        self._allocations = 0
        self._allocator: Callable[..., Plan] = allocate  # chosen for the device when the run starts

    # -- public -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop at the next iteration boundary (all workers agree on it)."""
        self._stop.set()
        if self._shared is not None:
            self._shared.request_stop(0)

    def readiness(self) -> str | None:
        """``/ready``: None once the node serves (pool loaded, every worker loaded its experts and
        joined the process group, one iteration completed), else why not (one line)."""
        if self._stop.is_set() or self.abort.is_set():
            return "stopping"
        if not self._pool_loaded:
            return "loading the expert pool"
        workers = self.setup.local_workers
        if self._ready < workers:
            return f"{self._ready}/{workers} workers have loaded the model and joined the process group"
        if self._completed == 0 and self.options.serve is None:  # a server iterates once requests come
            return "waiting for the first iteration"
        return None

    def run(self) -> NodeReport:
        setup, options = self.setup, self.options
        ctx = torch.multiprocessing.get_context("spawn")
        self._ctx = ctx
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        procs: list[Any] = []
        queues: list[Any] = []
        try:
            self._start_metrics()
            self._allocator = self._make_allocator()
            self._pool_experts = hottest_experts(self._hotness, self._pooled)
            self._update_pressure()
            self._assignment = (
                static_table(setup.spec.num_layers, setup.spec.num_experts, setup.world, setup.slots),
                self._pool_experts,
            )
            if options.verify:
                self._reference = ModelWeights.load(self._reader, setup.torch_dtype)
            shared = SharedState.create(setup.local_workers, setup.slots, ctx)
            self._shared = shared
            if options.iterations is not None:
                shared.request_stop(options.iterations)
            if self._stop.is_set():
                shared.request_stop(0)
            results = ctx.Queue()
            controls = [ctx.Queue() for _ in range(setup.local_workers)]
            queues = [results, *controls]
            self._prepare_scripted(controls)
            os.environ.update(single_node_environment(setup))  # the spawned workers inherit it
            rendezvous = rendezvous_url(setup)
            for local, rank in enumerate(setup.ranks):
                args = WorkerArgs(
                    local_rank=local,
                    gpu=local // setup.workers_per_gpu,
                    shared_gpu=setup.workers_per_gpu > 1,
                    rank=rank,
                    world=setup.world,
                    rendezvous=rendezvous,
                    checkpoint=str(setup.checkpoint),
                    spec=setup.spec,
                    dtype=setup.dtype,
                    device=setup.device,
                    slots=setup.slots,
                    k=setup.k,
                    timeout_s=setup.slot_fill_timeout_s,
                    workload=options.workload,
                    shared=shared,
                    results=results,
                    control=controls[local],
                    parent_pid=os.getpid(),
                    verify=options.verify,
                    record=options.record,
                    serve=None if options.serve is None else options.serve[local],
                    dispatch=setup.dispatch,
                )
                proc = ctx.Process(target=worker_main, args=(args,), name=f"vexpert-worker-{rank}", daemon=True)
                proc.start()
                procs.append(proc)
            self._controls = controls
            self._serve(results, procs, shared)
            # the coordinator's last stats arrive as it stops: stop it first, or the report
            # misses the bytes of the last fills
            self._stop_coordinator()
            return self._report()
        finally:
            self.abort.set()
            self._stop_coordinator()  # its mappings of the workers' slots go before the workers do
            if setup.device == "cuda":
                for control in queues[1:]:
                    with contextlib.suppress(Exception):
                        control.put(Bye())
            _stop_processes(procs)
            for q in queues:
                q.cancel_join_thread()
                q.close()
            self.metrics.close()
            self._shared = None  # its semaphores are unlinked once nothing holds them
            torch.set_num_threads(threads)

    @property
    def coordinator_pid(self) -> int | None:
        """Pid of the coordinator process now running (None while there is none)."""
        proc = self._coordinator
        return proc.pid if proc is not None and proc.exitcode is None else None

    # -- setup ------------------------------------------------------------------------------

    def _log(self, line: str) -> None:
        if self.options.log is not None:
            self.options.log(line)

    def _start_metrics(self) -> None:
        m = self.metrics
        m.pooled_experts.set(self._pooled)
        m.allocation_interval.set(self._k)
        m.slot_bytes.set(self.setup.memory.slot_bytes_per_worker)
        m.pool_bytes.set(self.setup.memory.pool_bytes)
        m.degraded.set(0)
        m.coordinator_up.set(0)
        for mode in DISPATCH_MODES:
            m.dispatch.labels(mode=mode).set(int(mode == self.setup.dispatch))
        self._log(f"replica dispatch: {self.setup.dispatch} ({self.setup.dispatch_reason})")
        m.set_layers(m.vexperts, [0] * self.setup.spec.num_layers)
        m.pool_hit_ratio.set(1.0 if self._pooled >= self.setup.spec.num_experts else math.nan)
        m.pinned_memory_pressure.set(memory_pressure(self._pinned_bytes(self.setup.memory.pool_bytes), self.setup.host_memory_limit_bytes))
        if self.setup.metrics_port or self.options.metrics_addr:
            addr = self.options.metrics_addr or self.setup.metrics_addr
            try:
                self._metrics_port = m.serve(self.setup.metrics_port, addr, readiness=self.readiness)
            except OSError as exc:
                raise VExpertInputError(
                    "runtime.metrics_port", f"cannot serve metrics on {addr}:{self.setup.metrics_port}: {exc.strerror}", "pick a free port (0 disables)"
                ) from None
            if self.options.on_metrics is not None:
                self.options.on_metrics(self._metrics_port)

    def _pinned_bytes(self, pool_bytes: int) -> int:
        """Host bytes counted against ``runtime.host_memory_limit_bytes``, as :func:`check_memory`
        counts them: the pool, plus on CPU every worker's slots and base experts (on CUDA those are
        in GPU memory)."""
        return replace(self.setup.memory, pool_bytes=pool_bytes).host_bytes

    def _pool_bytes(self) -> int:
        """Bytes of the coordinator's L2 pool for the pooled experts the latest plan uses."""
        layers, pooled = self._pool_experts.shape
        return int(layers * pooled * self.setup.spec.expert_bytes(self.setup.torch_dtype))

    def _update_pressure(self) -> None:
        self.metrics.pinned_memory_pressure.set(
            memory_pressure(self._pinned_bytes(self._pool_bytes()), self.setup.host_memory_limit_bytes)
        )

    def _pooled_mask(self) -> torch.Tensor:
        """[L, E] bool: the experts the coordinator's pool holds (the allocator may replicate)."""
        experts = self._pool_experts
        mask = torch.zeros(experts.shape[0], self.setup.spec.num_experts, dtype=torch.bool)
        mask.scatter_(1, experts, True)
        return mask

    def _prepare_scripted(self, controls: list[Any]) -> None:
        """Tables of scripted plans go to the workers before anything can announce them."""
        for iteration in sorted(self.options.scripted_plans):
            self._plan_id += 1
            table = table_from_plan(self.options.scripted_plans[iteration], self._plan_id)
            for control in controls:
                control.put(table)
            self._scripted[iteration] = (table, self._pool_experts)
            self._remember(table)

    # -- coordinator process ----------------------------------------------------------------

    def _start_coordinator(self) -> None:
        """Spawn a coordinator (:mod:`~vexpert_runtime.node.coordinator`) on a pipe of its own; it
        re-opens the workers' slots, builds its pool and resumes filling where the workers are."""
        setup, options = self.setup, self.options
        assert self._shared is not None and self._assignment is not None
        ours, theirs = self._ctx.Pipe()
        args = CoordinatorArgs(
            checkpoint=str(setup.checkpoint),
            spec=setup.spec,
            dtype=setup.dtype,
            device=setup.device,
            ranks=setup.ranks,
            shared=self._shared,
            handles=[self._handles[i] for i in range(setup.local_workers)],
            conn=theirs,
            parent_pid=os.getpid(),
            plan=self._assignment,
            scripted=dict(self._scripted),
            k=self._k,
            filler=options.filler,
        )
        proc = self._ctx.Process(target=coordinator_main, args=(args,), name="vexpert-coordinator", daemon=True)
        proc.start()
        theirs.close()
        self._coordinator, self._conn = proc, ours
        self._coordinator_starts += 1
        self._sent_k = self._k
        self._log(f"coordinator process {proc.pid} started")

    def _coordinator_messages(self) -> None:
        conn = self._conn
        while conn is not None:
            try:
                if not conn.poll(0):
                    return
                msg = conn.recv()
            except (EOFError, OSError):
                return
            self._on_coordinator(msg)

    def _send(self, msg: Any) -> None:
        """To the coordinator, if one is running (a dead one gets the latest plan at its restart)."""
        if self._conn is not None and self._coordinator_attached:
            with contextlib.suppress(OSError):
                self._conn.send(msg)

    def _send_plan(self) -> None:
        """The latest plan, pickled by value: a tensor sent as itself would go through
        ``torch.multiprocessing``'s fd sharing, which a coordinator killed mid-receive interrupts."""
        if self._assignment is not None:
            self._send(NewPlan(pickle.dumps(self._assignment)))

    def _on_coordinator(self, msg: Any) -> None:
        if isinstance(msg, Attached):
            self._coordinator_attached = True
            self._pool_loaded = True
            self.metrics.coordinator_up.set(1)
            if self._coordinator_down_since is not None:
                self._log(
                    f"coordinator {msg.pid} attached at iteration {msg.iteration}, "
                    f"{time.monotonic() - self._coordinator_down_since:.1f} s after its predecessor died"
                )
                self._coordinator_down_since = None
            if self._sent_k != self._k:
                self._send(SetInterval(self._k))
                self._sent_k = self._k
            # a plan made while it was starting went into its spawn arguments or must follow now
            self._send_plan()
        elif isinstance(msg, PlanSwitched):
            if msg.plan_id != self._last_plan:
                self._last_plan = msg.plan_id
                self._switches.append((msg.iteration, msg.plan_id))
        elif isinstance(msg, FillTotals):
            self._streamed_now, self._copy_s_now = msg.bytes_streamed, msg.copy_s
        elif isinstance(msg, FillLoopDied):
            self._fill_loop_down = True
            self.metrics.slot_fill_errors.inc()
            self.metrics.degraded.set(1)
            self._log(f"slot fill loop died ({msg.error}): its coordinator exits and is restarted")
        elif isinstance(msg, CoordinatorFailed):
            lines = msg.traceback.strip().splitlines()
            self._log(f"coordinator failed: {lines[-1] if lines else '?'}")

    def _watch_coordinator(self) -> None:
        """If the coordinator process died, the workers keep serving on their base experts (no
        waiting: the shared state says none is attached) and it is restarted with backoff."""
        proc, now = self._coordinator, time.monotonic()
        if proc is not None and proc.exitcode is not None:
            self._coordinator_messages()  # what it sent before dying (its last stats)
            self._streamed_done += self._streamed_now
            self._copy_s_done += self._copy_s_now
            self._streamed_now, self._copy_s_now = 0, 0.0
            assert self._shared is not None and self._conn is not None
            self._shared.detach_coordinator()
            self._conn.close()
            self._coordinator, self._conn = None, None
            if self._fill_loop_down:  # it exited because its fill loop failed
                self.metrics.fill_loop_restarts.inc()
            self._coordinator_attached = self._fill_loop_down = False
            self._coordinator_down_since = now
            delay = min(30.0, self.options.fill_restart_delay_s * 2 ** min(self._coordinator_restarts, 5))
            self._coordinator_restart_at = now + delay
            self.metrics.degraded.set(1)
            self.metrics.coordinator_up.set(0)
            self._log(f"{_exit_line(proc)}: serving with base experts only, restarting it in {delay:.1f} s")
        if self._coordinator_restart_at is not None and now >= self._coordinator_restart_at and not self.abort.is_set():
            self._coordinator_restart_at = None
            self._coordinator_restarts += 1
            self.metrics.coordinator_restarts.inc()
            self._start_coordinator()

    def _stop_coordinator(self) -> None:
        proc, conn = self._coordinator, self._conn
        if proc is None:
            return
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(Exit())
        proc.join(timeout=5.0)
        if conn is not None:
            self._coordinator_messages()
            conn.close()
        self._streamed_done += self._streamed_now
        self._copy_s_done += self._copy_s_now
        self._streamed_now, self._copy_s_now = 0, 0.0
        _stop_processes([proc])
        self._coordinator, self._conn = None, None

    # -- main loop --------------------------------------------------------------------------

    def _serve(self, results: Any, procs: list[Any], shared: SharedState) -> None:
        """Handle worker messages until every worker is done. Allocation windows are handled before
        anything else in a batch and output verification only when the queue is idle, so a plan
        reaches the coordinator as early as possible."""
        setup = self.setup
        self._ready = self._done = 0
        self._procs = procs
        last_progress = time.monotonic()
        while self._done < setup.local_workers:
            self._coordinator_messages()
            self._watch_coordinator()
            batch = _drain(results, timeout=0.01 if self._pending_verify else 0.1)
            if not batch:
                if self._pending_verify:
                    self._verify(self._pending_verify.pop(0))
                    continue
                _check_alive(procs)
                limit = STARTUP_TIMEOUT_S if self._ready < setup.local_workers else COLLECTIVE_TIMEOUT_S
                if time.monotonic() - last_progress > limit:
                    raise RuntimeError(f"no progress from the workers for {limit:.0f} s")
            else:
                last_progress = time.monotonic()
            windows = [m for m in batch if isinstance(m, CountsWindow)]
            for window in windows:  # only the newest window of a backlog is worth an allocation
                self._on_window(window.start, window.data, allocate=window is windows[-1])
            for msg in batch:
                if not isinstance(msg, CountsWindow):
                    self._handle(msg)
            self._maybe_reload()
            if self._k != self._sent_k and self._coordinator_attached:
                self._send(SetInterval(self._k))
                self._sent_k = self._k
        while self._pending_verify:
            self._verify(self._pending_verify.pop(0))

    def _handle(self, msg: Any) -> None:
        setup = self.setup
        if isinstance(msg, SlotsExported):
            self._handles[msg.local_rank] = msg.handle
            if len(self._handles) == setup.local_workers:
                self._start_coordinator()
        elif isinstance(msg, Heartbeat):
            pass  # resets the no-progress clock: an idle server runs no iterations
        elif isinstance(msg, WorkerReady):
            self._ready += 1
            if self._ready == setup.local_workers:
                self._started_at = time.perf_counter()
                self._window_clock = self._started_at
        elif isinstance(msg, IterationDone):
            self._on_iteration(msg)
        elif isinstance(msg, WorkerDone):
            self._done += 1
        elif isinstance(msg, WorkerInputError):
            raise VExpertInputError(msg.field, f"worker {msg.rank}: {msg.problem}", msg.fix)
        elif isinstance(msg, WorkerFailed):
            dead = _first_dead(self._procs)
            if dead is not None:
                last = msg.traceback.strip().splitlines()[-1] if msg.traceback.strip() else ""
                raise RuntimeError(f"{dead}; worker {msg.rank} then failed: {last}")
            raise RuntimeError(f"worker {msg.rank} failed:\n{msg.traceback}")

    def _verify(self, job: tuple[int, int, np.ndarray]) -> None:
        """Compare one rank's output of one iteration with the single-process reference."""
        iteration, rank, output = job
        assert self._reference is not None
        workload = self.options.workload
        x = workload.inputs(iteration, rank, self.setup.spec.hidden_size, self.setup.torch_dtype)
        ref, _ = reference_forward(x, self._reference, workload.logit_bias(iteration))
        error = relative_error(torch.from_numpy(output), ref)
        record = self._records[iteration]
        record.rel_error = max(record.rel_error or 0.0, error)
        self._max_error = max(self._max_error or 0.0, error)

    def _on_iteration(self, msg: IterationDone) -> None:
        rank, iteration, waited, plan_ids = msg.rank, msg.iteration, msg.wait_s, msg.plan_ids
        record = self._records.setdefault(iteration, IterationRecord(iteration))
        record.step_s = max(record.step_s, msg.step_s)
        record.wait_s = max(record.wait_s, waited)
        record.degraded_groups = max(record.degraded_groups, msg.degraded_layers)
        record.plan_ids = plan_ids
        record.reports += 1
        if msg.computed is not None:
            record.computed[rank] = msg.computed
            record.slot_checksums[rank] = msg.slot_checksums or []
        if msg.output is not None and self._reference is not None:
            self._pending_verify.append((iteration, rank, msg.output))
        self.metrics.slot_wait.observe(waited)
        if msg.rescued_layers:
            self.metrics.rescued_layers.inc(msg.rescued_layers)
        if msg.graphed:
            self.metrics.graphed_steps.inc()
            self._graphed_steps += 1
        if record.reports == self.setup.local_workers:
            self.metrics.step_time.observe(record.step_s)
            self.metrics.iterations.inc()
            self.metrics.plan_id.set(plan_ids[0] if plan_ids else 0)
            if record.degraded_groups:
                self.metrics.degraded_groups.inc(record.degraded_groups)
                self._degraded_total += record.degraded_groups
                # here too: a batch's window is handled before its iteration reports, so the
                # window's own check may not have seen this iteration yet
                self.metrics.degraded.set(1)
            self._last_iter_at = time.perf_counter()
            self._completed += 1
            self._decay.plan(iteration, max(plan_ids, default=0))
            self.metrics.balance_decay.set(self._decay.value)
        self._sync_bytes()

    def _sync_bytes(self) -> None:
        streamed = self._streamed_done + self._streamed_now
        if streamed > self._bytes_reported:
            self.metrics.bytes_streamed.inc(streamed - self._bytes_reported)
            self._bytes_reported = streamed

    def _recent_rate(self, iterations_done: int) -> float:
        """Tokens/s over the last ≥ RATE_HORIZON_S of windows. Windows often reach the supervisor
        in one batch, microseconds apart, so the time between two of them says nothing."""
        now = time.perf_counter()
        marks = self._rate_marks
        if not marks:
            marks.append((self._window_clock or now, 0))
        marks.append((now, iterations_done))
        while len(marks) > 2 and now - marks[1][0] >= RATE_HORIZON_S:
            marks.popleft()  # keep the newest mark that is still ≥ the horizon old
        (t0, i0), (t1, i1) = marks[0], marks[-1]
        if t1 <= t0:
            return 0.0
        return (i1 - i0) * self.setup.world * self.options.workload.tokens_per_worker / (t1 - t0)

    def _on_window(self, start: int, data: np.ndarray, allocate: bool = True) -> None:
        """Balance bookkeeping, metrics and (every window) a new allocation."""
        spec, setup = self.setup.spec, self.setup
        window = torch.from_numpy(data)
        self._windows.append((start, int(window.shape[0])))
        counts = window[..., : spec.num_experts].to(torch.float32)  # [n, L, E]
        loads = window[..., spec.num_experts :].to(torch.float32)  # [n, L, N]
        static = balance_ratio(base_gpu_loads(counts, self._base_gpu, setup.world))  # [n, L]
        measured = balance_ratio(loads)
        for i in range(window.shape[0]):
            record = self._records.setdefault(start + i, IterationRecord(start + i))
            record.static_balance = float(static[i].mean())
            record.vexpert_balance = float(measured[i].mean())
            self._decay.balance(start + i, record.vexpert_balance)
        self.metrics.balance_decay.set(self._decay.value)
        m = self.metrics
        m.set_layers(m.balance, measured.mean(0).tolist())
        m.set_layers(m.static_balance, static.mean(0).tolist())
        recent = [self._records[i] for i in range(start, start + window.shape[0]) if i in self._records]
        down = self._fill_loop_down or not self._coordinator_attached
        m.degraded.set(1 if any(r.degraded_groups for r in recent) or down else 0)
        rate = self._recent_rate(start + window.shape[0])
        m.tokens_per_second.set(rate)
        self._hotness = 0.8 * self._hotness + counts.sum(0).to(torch.float64)
        if allocate and self.options.allocate and not self._scripted:
            self._allocate(counts.sum(0))
        self._sync_bytes()
        self._prune()
        if self.options.progress is not None:
            errors = [r.rel_error for r in recent if r.rel_error is not None]
            last = start + window.shape[0]
            self.options.progress(
                Progress(
                    iteration=last,
                    total=self.options.iterations,
                    phase=self.options.workload.phase_name(last - 1),
                    static_balance=float(static.mean()),
                    vexpert_balance=float(measured.mean()),
                    tokens_per_s=rate,
                    vexperts=list(self._vexperts),
                    plan_id=self._last_plan,
                    max_rel_error=self._max_error if errors or self._max_error is not None else None,
                    bytes_streamed=self._bytes_reported,
                    degraded_groups=self._degraded_total,
                )
            )

    def _allocate(self, counts: torch.Tensor) -> None:
        """Run the allocator on a window's counts [L, E]; the fill loop picks the plan up at its next
        iteration boundary (workers never wait for this)."""
        setup = self.setup
        if self._pooled != self._pool_experts.shape[1] or self._pooled < setup.spec.num_experts:
            wanted = hottest_experts(self._hotness, self._pooled)
            if wanted.shape != self._pool_experts.shape or not torch.equal(wanted, self._pool_experts):
                self._pool_experts = wanted  # the coordinator refreshes its pool with the plan
                self.metrics.pooled_experts.set(wanted.shape[1])
                self.metrics.pool_bytes.set(self._pool_bytes())
                self._update_pressure()
        start = time.perf_counter()
        consts, config = self._allocator_inputs()
        mask = self._pooled_mask()
        plan = self._allocator(counts, self._base_gpu, setup.world, config, setup.profile, consts, pooled=mask)
        elapsed = time.perf_counter() - start
        self._allocator_s.append(elapsed)
        self._allocations += 1
        self.metrics.allocator_time.observe(elapsed)
        if self._pool_experts.shape[1] < setup.spec.num_experts:  # what the allocator wanted vs what Np allowed
            unrestricted = self._allocator(counts, self._base_gpu, setup.world, config, setup.profile, consts)
            self._hits.add(*pool_hits(unrestricted.slot_expert, mask))
            self.metrics.pool_hit_ratio.set(self._hits.value)
        else:
            self.metrics.pool_hit_ratio.set(1.0)
        self._plan_id += 1
        table = table_from_plan(plan, self._plan_id)
        for control in self._controls:
            control.put(table)
        self._assignment = (table, self._pool_experts)
        self._send_plan()
        self._remember(table)
        self._vexperts = plan.vexperts.tolist()
        self.metrics.set_layers(self.metrics.vexperts, [float(v) for v in self._vexperts])

    def _allocator_inputs(self) -> tuple[InferenceConstants, AllocatorConfig]:
        setup = self.setup
        consts = InferenceConstants(
            tokens_per_gpu=self.options.workload.tokens_per_worker,
            top_k=setup.spec.top_k,
            experts_per_gpu=setup.spec.num_experts // setup.world,
            expert_bytes=setup.spec.expert_bytes(setup.torch_dtype),
        )
        config = AllocatorConfig(group_size=setup.group_size, vmax=setup.vmax, balance_threshold=setup.balance_threshold)
        return consts, config

    def _make_allocator(self) -> Callable[..., Plan]:
        """The options' allocator, else ``allocate`` on CPU nodes and, on GPU nodes, the graphed
        allocator on the first GPU, compiled and captured here, before any process starts: compiling
        beside the serving loop would starve it of the interpreter for the ≈20 s it takes (the
        supervisor uses no other CUDA: it passes the workers' IPC handles on unopened)."""
        if self.options.allocator is not None:
            return self.options.allocator
        if self.setup.device != "cuda":
            return allocate
        spec = self.setup.spec
        consts, config = self._allocator_inputs()
        import torch._inductor.config as inductor

        inductor.compile_threads = 1  # no pool of compile worker processes outliving the compile
        device = DeviceAllocator("cuda:0")
        started = time.perf_counter()
        try:
            device.warm_up(torch.ones(spec.num_layers, spec.num_experts), self._base_gpu, self.setup.world, config,
                           self.setup.profile, consts)
        except Exception as exc:  # keep serving: allocate on the CPU instead
            self._log(f"graphed allocator unavailable, allocating on the CPU: {exc}")
            return allocate
        self._log(f"graphed allocator ready on cuda:0 ({time.perf_counter() - started:.1f} s to compile and capture)")
        return device

    def _prune(self) -> None:
        """Keep the last ``keep_history`` iterations' records (and windows, allocator times, plan
        switches; a tenth as many plans' tables) unless every detail was asked for (``record``)."""
        keep = self.options.keep_history
        if self.options.record or len(self._records) <= keep + keep // 10:
            return
        for iteration in sorted(self._records)[: len(self._records) - keep]:
            del self._records[iteration]
        for history in (self._windows, self._allocator_s, self._switches):
            del history[: max(0, len(history) - keep)]
        plans = max(16, keep // 10)
        for plan_id in sorted(self._tables)[: max(0, len(self._tables) - plans)]:
            self._tables.pop(plan_id, None)
            self._plan_pools.pop(plan_id, None)

    def _remember(self, table: RoutingTable) -> None:
        self._tables[table.plan_id] = table
        self._plan_pools[table.plan_id] = self._pool_experts.tolist()

    # -- config reload ----------------------------------------------------------------------

    def _maybe_reload(self) -> None:
        path = self.options.config_path
        now = time.monotonic()
        if path is None or now - self._last_reload_check < 0.5:
            return
        self._last_reload_check = now
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return
        if self._config_mtime is None:
            self._config_mtime = mtime
            return
        if mtime == self._config_mtime:
            return
        self._config_mtime = mtime
        try:
            if not path.read_bytes().strip():  # a half-written file must not reset tuning to the defaults
                raise VExpertInputError("--config", f"{path} is empty")
            tuning = load_runtime_config(path).tuning
            self._apply_tuning(tuning)
        except Exception as exc:  # a bad file (invalid values, not YAML, not UTF-8, unreadable) never stops the node
            self.metrics.reload_errors.inc()
            self._log(f"config reload rejected, keeping k={self._k} Np={self._pooled}: {exc}")
            return
        self.metrics.reloads.inc()

    def _apply_tuning(self, tuning: TuningConfig) -> None:
        pooled = tuning.pooled_experts or self.setup.spec.num_experts
        check_pooled(pooled, self.setup.spec.num_experts)
        memory = memory_plan(
            self.setup.spec, self.setup.torch_dtype, pooled, self.setup.slots, self.setup.world, self.setup.local_workers, self.setup.device
        )
        check_memory(memory, self.setup.host_memory_limit_bytes)
        if tuning.allocation_interval != self._k or pooled != self._pooled:
            self._log(f"config reloaded: k {self._k} → {tuning.allocation_interval}, Np {self._pooled} → {pooled}")
        if tuning.allocation_interval != self._k:  # intervals of the old k say nothing about the new one
            self._decay.reset()
            self.metrics.balance_decay.set(self._decay.value)
        if pooled != self._pooled:  # nor hits of the old pool about the new one
            self._hits.reset()
            self.metrics.pool_hit_ratio.set(1.0 if pooled >= self.setup.spec.num_experts else math.nan)
        self._k = tuning.allocation_interval
        self._pooled = pooled
        self.metrics.allocation_interval.set(self._k)
        self.metrics.pooled_experts.set(self._pooled)

    # -- report -----------------------------------------------------------------------------

    def _report(self) -> NodeReport:
        records = [self._records[i] for i in sorted(self._records)]
        static = [r.static_balance for r in records if r.static_balance is not None]
        measured = [r.vexpert_balance for r in records if r.vexpert_balance is not None]
        iterations = self._completed
        elapsed = (self._last_iter_at or 0.0) - (self._started_at or 0.0)
        tokens = iterations * self.setup.world * self.options.workload.tokens_per_worker
        self._sync_bytes()
        return NodeReport(
            iterations=iterations,
            static_balance=float(np.mean(static)) if static else float("nan"),
            vexpert_balance=float(np.mean(measured)) if measured else float("nan"),
            tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
            max_rel_error=self._max_error,
            slot_bytes_per_worker=self.setup.memory.slot_bytes_per_worker,
            pool_bytes=self._pool_bytes(),
            bytes_streamed=self._streamed_done + self._streamed_now,
            plan_switches=list(self._switches),
            allocations=self._allocations,
            allocator_s=list(self._allocator_s),
            degraded_groups=self._degraded_total,
            graphed_steps=self._graphed_steps,
            metrics_port=self._metrics_port,
            records=records,
            metrics_text=self.metrics.render(),
            pooled=int(self._pool_experts.shape[1]),
            k=self._k,
            windows=list(self._windows),
            tables=dict(self._tables),
            plan_pools=dict(self._plan_pools),
            copy_s=self._copy_s_done + self._copy_s_now,
            dispatch=self.setup.dispatch,
        )


def pool_hits(slot_expert: torch.Tensor, pooled: torch.Tensor) -> tuple[int, int]:
    """(vExperts whose expert is pooled, vExperts) of a plan's ``slot_expert`` [L, N, S] (−1 = unused)
    under the pool mask ``pooled`` [L, E] bool."""
    used = slot_expert >= 0
    layer = torch.arange(slot_expert.shape[0]).view(-1, 1, 1).expand_as(slot_expert)
    hits = pooled[layer[used], slot_expert[used]]
    return int(hits.sum()), int(used.sum())


def _drain(results: Any, timeout: float) -> list[Any]:
    """Every message now in the queue (waiting up to ``timeout`` for the first)."""
    try:
        batch = [results.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            batch.append(results.get_nowait())
        except queue.Empty:
            return batch


def _check_alive(procs: list[Any]) -> None:
    for proc in procs:
        if proc.exitcode not in (None, 0):
            raise RuntimeError(_exit_line(proc))


def _exit_line(proc: Any) -> str:
    line = f"{proc.name} exited with code {proc.exitcode}"
    if proc.exitcode < 0:
        with contextlib.suppress(ValueError):
            line += f" (killed by {signal.Signals(-proc.exitcode).name})"
    return line


def _first_dead(procs: list[Any], wait_s: float = 1.0) -> str | None:
    """The exit line of a worker that died, waiting briefly: when one worker is killed the others
    fail in their next collective, and the dead one is the cause worth reporting."""
    deadline = time.monotonic() + wait_s
    while True:
        for proc in procs:
            if proc.exitcode not in (None, 0):
                return _exit_line(proc)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _stop_processes(procs: list[Any]) -> None:
    """Join workers; terminate, then kill, whatever does not exit (only our own children)."""
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)


def run_node(setup: NodeSetup, options: NodeOptions | None = None) -> NodeReport:
    """Run one node to completion (see :class:`NodeRuntime`)."""
    return NodeRuntime(setup, options).run()


def install_signal_handlers(runtime: NodeRuntime) -> None:
    """SIGTERM/SIGINT: stop at the next iteration boundary; a second signal aborts."""

    def handler(signum: int, _frame: Any) -> None:
        if runtime._stop.is_set():
            runtime.abort.set()
            raise KeyboardInterrupt
        print(f"vexpert node: signal {signum}, stopping at the next iteration", file=sys.stderr)
        runtime.request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
