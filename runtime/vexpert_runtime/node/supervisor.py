"""One vExpert node: a supervisor (this process), a coordinator process and one worker process per
GPU (or CPU worker).

* The **supervisor** (:class:`NodeRuntime`, this module) owns the shared protocol state, the workers
  and their queues, and runs the message loop; each message goes to the piece whose job it is: the
  :class:`~.balance.BalanceState` (load and placement; every ``k`` iterations the next plan from the
  all-reduced expert counts), the :class:`~.coordinator_handle.CoordinatorHandle` (the coordinator
  process: spawn, watch, back off, send plans), the :class:`~.history.RunHistory` (per-iteration
  records and the report), the :class:`~.verification.OutputVerifier` (outputs against the
  single-process reference, on request) and :class:`~.config_reload.ConfigReload` (the config
  file's ``tuning`` section when it changes). It serves the node's metrics and shuts everything down
  cleanly.
* The **coordinator** (:mod:`~vexpert_runtime.node.coordinator`, a child process) owns the L2 expert pool
  and fills the workers' L1 slots through the :mod:`~vexpert_runtime.node.protocol` fill loop (a thread
  running one group ahead of the workers), serving the newest plan in effect of the supervisor's
  schedule (:mod:`~vexpert_runtime.node.plans`).
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

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import CheckpointReader
from vexpert_runtime.model.dispatch import DISPATCH_MODES
from vexpert_runtime.model.reference import ModelWeights
from vexpert_runtime.node.balance import BalanceState, PlanMade, node_allocator
from vexpert_runtime.node.config_reload import ConfigReload, Tuning
from vexpert_runtime.node.coordinator_handle import CoordinatorHandle
from vexpert_runtime.node.history import RunHistory, RunTotals, compose_report
from vexpert_runtime.node.messages import (
    Bye,
    CountsWindow,
    FromWorker,
    Heartbeat,
    IterationDone,
    PlanTable,
    SlotsExported,
    WorkerDone,
    WorkerFailed,
    WorkerInputError,
    WorkerReady,
)
from vexpert_runtime.node.metrics import NodeMetrics, memory_pressure
from vexpert_runtime.node.plans import ScheduledPlan
from vexpert_runtime.node.processes import (
    check_alive,
    drain,
    first_dead,
    stop_processes,
    stop_signals_held,
)
from vexpert_runtime.node.protocol import SharedState
from vexpert_runtime.node.report import NodeOptions, NodeReport, Progress
from vexpert_runtime.node.setup import NodeSetup, rendezvous_url, single_node_environment
from vexpert_runtime.node.verification import OutputVerifier, VerifyJob
from vexpert_runtime.node.worker import COLLECTIVE_TIMEOUT_S, STARTUP_TIMEOUT_S, worker_main
from vexpert_runtime.node.worker_args import WorkerArgs

BalanceFactory = Callable[[NodeSetup, NodeOptions], BalanceState]


def default_balance(setup: NodeSetup, options: NodeOptions) -> BalanceState:
    """The node's balance state: the options' allocator, else ``allocate`` until the run chooses one."""
    balance = BalanceState(setup, options.workload.tokens_per_worker)
    if options.allocator is not None:
        balance.allocator = options.allocator
    return balance


# ---------------------------------------------------------------------------------------------
# Supervisor
# ---------------------------------------------------------------------------------------------


class NodeRuntime:
    """Runs one node until ``options.iterations`` or :meth:`request_stop`: starts the workers and
    the coordinator and runs the message loop, handing each message to the piece whose job it is —
    the balance state (:mod:`.balance`), the coordinator handle (:mod:`.coordinator_handle`), the
    run's history (:mod:`.history`), output verification (:mod:`.verification`) and config reload
    (:mod:`.config_reload`).

    ``balance`` makes the node's balance state (a :class:`BalanceState` or a subclass: how the node
    learns load and makes plans)."""

    def __init__(self, setup: NodeSetup, options: NodeOptions | None = None,
                 balance: BalanceFactory = default_balance) -> None:
        self.setup = setup
        self.options = options = options or NodeOptions()
        self.metrics = NodeMetrics(setup.spec.num_layers)
        self.abort = threading.Event()
        self._stop = threading.Event()
        self.balance = balance(setup, options)
        self.history = RunHistory(setup.local_workers, setup.world * options.workload.tokens_per_worker)
        self.reload = ConfigReload(options.config_path, setup, self.metrics, self._log)
        self.coordinator = CoordinatorHandle(None, setup, self.metrics, self._log, options.filler,
                                             options.fill_restart_delay_s, self.abort)
        self.verifier: OutputVerifier | None = None
        self._shared: SharedState | None = None
        self._controls: list[Any] = []
        self._procs: list[Any] = []
        self._ready = self._done = 0
        self._bytes_reported = 0
        self._last_degraded = False  # whether the last iteration every local worker finished ran degraded
        self._metrics_port: int | None = None

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
        if not self.coordinator.pool_loaded:
            return "loading the expert pool"
        workers = self.setup.local_workers
        if self._ready < workers:
            return f"{self._ready}/{workers} workers have loaded the model and joined the process group"
        # a server iterates once requests come; a count window (it may be handled before the reports
        # of its iterations) also says iterations completed
        if self.history.completed == 0 and not self.balance.windows and self.options.serve is None:
            return "waiting for the first iteration"
        return None

    @property
    def coordinator_pid(self) -> int | None:
        """Pid of the coordinator process now running (None while there is none)."""
        return self.coordinator.pid

    def run(self) -> NodeReport:
        setup = self.setup
        ctx = torch.multiprocessing.get_context("spawn")
        self.coordinator.ctx = ctx
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        queues: list[Any] = []
        try:
            self._start_metrics()
            if self.options.allocator is None:
                self.balance.allocator = node_allocator(setup, self.options.workload.tokens_per_worker, self._log)
            if self.options.verify:
                reference = ModelWeights.load(CheckpointReader(setup.checkpoint, setup.spec), setup.torch_dtype)
                self.verifier = OutputVerifier(reference, self.options.workload, setup.spec.hidden_size, setup.torch_dtype)
            shared = self._shared = self.coordinator.shared = SharedState.create(setup.local_workers, setup.slots, ctx)
            if self.options.iterations is not None:
                shared.request_stop(self.options.iterations)
            if self._stop.is_set():
                shared.request_stop(0)
            results = ctx.Queue()
            self._controls = [ctx.Queue() for _ in range(setup.local_workers)]
            queues = [results, *self._controls]
            for scheduled in self.balance.opening_plans():
                self._schedule(scheduled)
            self._update_pool_gauges()
            self._procs = self._start_workers(ctx, shared, results)
            self._serve(results, self._procs)
            # the coordinator's last stats arrive as it stops: stop it first, or the report
            # misses the bytes of the last fills
            self.coordinator.stop()
            return self._report()
        finally:
            self.abort.set()
            self.coordinator.stop()  # its mappings of the workers' slots go before the workers do
            if setup.device == "cuda":
                for control in self._controls:
                    with contextlib.suppress(Exception):
                        control.put(Bye())
            stop_processes(self._procs)
            for q in queues:
                q.cancel_join_thread()
                q.close()
            self.metrics.close()
            self._shared = None  # its semaphores are unlinked once nothing holds them
            torch.set_num_threads(threads)

    # -- setup ------------------------------------------------------------------------------

    def _log(self, line: str) -> None:
        if self.options.log is not None:
            self.options.log(line)

    def _start_workers(self, ctx: Any, shared: SharedState, results: Any) -> list[Any]:
        """Spawn one worker process per local EP rank."""
        os.environ.update(single_node_environment(self.setup))  # the spawned workers inherit it
        rendezvous = rendezvous_url(self.setup)  # one per group start: every worker meets there
        procs = []
        for local, rank in enumerate(self.setup.ranks):
            args = worker_args(self.setup, self.options, local, rendezvous, shared, results, self._controls[local])
            proc = ctx.Process(target=worker_main, args=(args,), name=f"vexpert-worker-{rank}", daemon=True)
            with stop_signals_held():
                proc.start()
            procs.append(proc)
        return procs

    def _start_metrics(self) -> None:
        m, setup = self.metrics, self.setup
        m.pooled_experts.set(self.balance.pooled)
        m.allocation_interval.set(self.balance.k)
        m.slot_bytes.set(setup.memory.slot_bytes_per_worker)
        m.pool_bytes.set(setup.memory.pool_bytes)
        m.degraded.set(0)
        m.coordinator_up.set(0)
        for mode in DISPATCH_MODES:
            m.dispatch.labels(mode=mode).set(int(mode == setup.dispatch))
        self._log(f"replica dispatch: {setup.dispatch} ({setup.dispatch_reason})")
        m.set_layers(m.vexperts, [0] * setup.spec.num_layers)
        m.pool_hit_ratio.set(1.0 if self.balance.pooled >= setup.spec.num_experts else math.nan)
        m.pinned_memory_pressure.set(memory_pressure(self._pinned_bytes(setup.memory.pool_bytes), setup.host_memory_limit_bytes))
        if setup.metrics_port or self.options.metrics_addr:
            addr = self.options.metrics_addr or setup.metrics_addr
            try:
                self._metrics_port = m.serve(setup.metrics_port, addr, readiness=self.readiness)
            except OSError as exc:
                raise VExpertInputError(
                    "runtime.metrics_port", f"cannot serve metrics on {addr}:{setup.metrics_port}: {exc.strerror}", "pick a free port (0 disables)"
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
        layers, pooled = self.balance.pool_experts.shape
        return int(layers * pooled * self.setup.spec.expert_bytes(self.setup.torch_dtype))

    def _update_pool_gauges(self) -> None:
        self.metrics.pinned_memory_pressure.set(
            memory_pressure(self._pinned_bytes(self._pool_bytes()), self.setup.host_memory_limit_bytes)
        )

    # -- plans ------------------------------------------------------------------------------

    def _schedule(self, scheduled: ScheduledPlan) -> None:
        """A plan's table to every worker (before anything can announce it), the plan to the coordinator."""
        plan = scheduled.plan
        if plan.plan_id != 0:  # the workers start with the static table
            for control in self._controls:
                control.put(PlanTable(plan.table))
        self.coordinator.schedule_plan(scheduled)

    def _publish_plan(self, made: PlanMade) -> None:
        """A new plan goes out (the fill loop picks it up at its next iteration boundary; workers
        never wait for this) and into the metrics."""
        m = self.metrics
        if made.pool_changed:
            m.pooled_experts.set(made.plan.pooled.shape[1])
            m.pool_bytes.set(self._pool_bytes())
            self._update_pool_gauges()
        m.allocator_time.observe(made.allocator_s)
        m.pool_hit_ratio.set(self.balance.pool_hit_ratio)
        self._schedule(ScheduledPlan(made.plan))
        m.set_layers(m.vexperts, [float(v) for v in made.vexperts])

    # -- main loop --------------------------------------------------------------------------

    def _serve(self, results: Any, procs: list[Any]) -> None:
        """Handle worker messages until every worker is done. Allocation windows are handled before
        anything else in a batch and output verification only when the queue is idle, so a plan
        reaches the coordinator as early as possible."""
        workers = self.setup.local_workers
        self._ready = self._done = 0
        self._procs = procs
        last_progress = time.monotonic()
        verifier = self.verifier
        while self._done < workers:
            self.coordinator.poll()
            pending = verifier is not None and bool(verifier.pending)
            batch: list[FromWorker] = drain(results, timeout=0.01 if pending else 0.1)
            if not batch:
                if pending:
                    self._verify_next()
                    continue
                check_alive(procs)
                limit = STARTUP_TIMEOUT_S if self._ready < workers else COLLECTIVE_TIMEOUT_S
                if time.monotonic() - last_progress > limit:
                    raise RuntimeError(f"no progress from the workers for {limit:.0f} s")
            else:
                last_progress = time.monotonic()
            windows = [m for m in batch if isinstance(m, CountsWindow)]
            for window in windows:  # only the newest window of a backlog is worth an allocation
                self._on_window(window, allocate=window is windows[-1])
            for msg in batch:
                if not isinstance(msg, CountsWindow):
                    self._handle(msg)
            self._serve_reload()
        while verifier is not None and verifier.pending:
            self._verify_next()

    def _handle(self, msg: FromWorker) -> None:
        if isinstance(msg, SlotsExported):
            self.coordinator.slots_exported(msg.local_rank, msg.handle)
        elif isinstance(msg, Heartbeat):
            pass  # resets the no-progress clock: an idle server runs no iterations
        elif isinstance(msg, WorkerReady):
            self._ready += 1
            if self._ready == self.setup.local_workers:
                self.history.workers_ready()
        elif isinstance(msg, IterationDone):
            self._on_iteration(msg)
        elif isinstance(msg, WorkerDone):
            self._done += 1
        elif isinstance(msg, WorkerInputError):
            raise VExpertInputError(msg.field, f"worker {msg.rank}: {msg.problem}", msg.fix)
        elif isinstance(msg, WorkerFailed):
            dead = first_dead(self._procs)
            if dead is not None:
                last = msg.traceback.strip().splitlines()[-1] if msg.traceback.strip() else ""
                raise RuntimeError(f"{dead}; worker {msg.rank} then failed: {last}")
            raise RuntimeError(f"worker {msg.rank} failed:\n{msg.traceback}")

    def _verify_next(self) -> None:
        assert self.verifier is not None
        self.history.on_error(*self.verifier.verify_next())

    def _on_iteration(self, msg: IterationDone) -> None:
        m = self.metrics
        record = self.history.on_iteration(msg)
        if msg.output is not None and self.verifier is not None:
            self.verifier.add(VerifyJob(msg.iteration, msg.rank, msg.output))
        m.slot_wait.observe(msg.wait_s)
        if msg.rescued_layers:
            m.rescued_layers.inc(msg.rescued_layers)
        if msg.graphed:
            m.graphed_steps.inc()
        for generation, seconds in enumerate(msg.gc_s):
            if seconds:
                m.worker_gc_seconds.labels(str(generation)).inc(seconds)
        if msg.gc_frozen:
            m.worker_gc_frozen.labels(str(msg.rank)).set(msg.gc_frozen)
        if record.reports == self.setup.local_workers:
            m.step_time.observe(record.step_s)
            m.iterations.inc()
            m.plan_id.set(msg.plan_ids[0] if msg.plan_ids else 0)
            self._last_degraded = record.degraded_groups > 0
            if record.degraded_groups:
                m.degraded_groups.inc(record.degraded_groups)
                # here too: a batch's window is handled before its iteration reports, so the
                # window's own check may not have seen this iteration yet
                m.degraded.set(1)
            self.balance.iteration_done(msg.iteration, msg.plan_ids)
            m.balance_decay.set(self.balance.decay.value)
        self._sync_bytes()

    def _sync_bytes(self) -> None:
        streamed = self.coordinator.fills.bytes_streamed
        if streamed > self._bytes_reported:
            self.metrics.bytes_streamed.inc(streamed - self._bytes_reported)
            self._bytes_reported = streamed

    def _on_window(self, window: CountsWindow, allocate: bool = True) -> None:
        """Balance bookkeeping, metrics and (every window) a new allocation."""
        m, balance = self.metrics, self.balance
        measured = balance.record(window)
        recent = self.history.on_window(measured)
        m.balance_decay.set(balance.decay.value)
        m.set_layers(m.balance, measured.measured.mean(0).tolist())
        m.set_layers(m.static_balance, measured.static.mean(0).tolist())
        # the window often reaches the supervisor before its iterations' reports (``recent`` partial
        # or empty): the last completed iteration speaks for the node until they arrive
        degraded = self._last_degraded or any(r.degraded_groups for r in recent) or self.coordinator.degraded
        m.degraded.set(1 if degraded else 0)
        rate = self.history.recent_rate(measured.end)
        m.tokens_per_second.set(rate)
        if allocate and self.options.allocate:
            skipped = balance.idle_windows
            made = balance.next_plan(measured.counts)
            if made is not None:
                self._publish_plan(made)
            if balance.idle_windows > skipped:  # the plan in effect was kept: a decay interval starts after the window
                m.allocations_skipped.inc(balance.idle_windows - skipped)
                balance.decay.kept(measured.end)
                m.pool_hit_ratio.set(balance.pool_hit_ratio)
        self._sync_bytes()
        self._prune()
        if self.options.progress is not None:
            self.options.progress(self._progress(measured.end, float(measured.static.mean()),
                                                 float(measured.measured.mean()), rate, recent))

    def _progress(self, last: int, static: float, measured: float, rate: float, recent: list[Any]) -> Progress:
        history = self.history
        errors = [r.rel_error for r in recent if r.rel_error is not None]
        return Progress(
            iteration=last,
            total=self.options.iterations,
            phase=self.options.workload.phase_name(last - 1),
            static_balance=static,
            vexpert_balance=measured,
            tokens_per_s=rate,
            vexperts=list(self.balance.vexperts),
            plan_id=self.coordinator.last_plan,
            max_rel_error=history.max_error if errors or history.max_error is not None else None,
            bytes_streamed=self._bytes_reported,
            degraded_groups=history.degraded_total,
        )

    def _prune(self) -> None:
        """Keep the last ``keep_history`` iterations' records (and windows, allocator times, plan
        switches; a tenth as many plans' tables)."""
        keep = self.options.keep_history
        if self.history.prune(keep):
            self.balance.prune(keep)
            self.coordinator.prune(keep)

    def _serve_reload(self) -> None:
        """Retune when the config file changed to good values."""
        tuning = self.reload.check(Tuning(self.balance.k, self.balance.pooled))
        if tuning is not None:
            self._retune(tuning)

    def _retune(self, tuning: Tuning) -> None:
        """A reloaded config's k and Np (checked): the next windows and pool use them."""
        m, balance = self.metrics, self.balance
        new_k, new_pool = tuning.k != balance.k, tuning.pooled != balance.pooled
        balance.retune(tuning.k, tuning.pooled)
        if new_k:  # the decay's history restarted
            m.balance_decay.set(balance.decay.value)
        if new_pool:  # and so did the pool hits'
            m.pool_hit_ratio.set(1.0 if tuning.pooled >= self.setup.spec.num_experts else math.nan)
        self.coordinator.set_interval(tuning.k)
        m.allocation_interval.set(balance.k)
        m.pooled_experts.set(balance.pooled)

    def _report(self) -> NodeReport:
        self._sync_bytes()
        fills = self.coordinator.fills
        totals = RunTotals(
            bytes_streamed=fills.bytes_streamed,
            copy_s=fills.copy_s,
            plan_switches=self.coordinator.switches,
            slot_bytes_per_worker=self.setup.memory.slot_bytes_per_worker,
            pool_bytes=self._pool_bytes(),
            metrics_port=self._metrics_port,
            metrics_text=self.metrics.render(),
            dispatch=self.setup.dispatch,
        )
        return compose_report(self.history, self.balance, totals)


def worker_args(setup: NodeSetup, options: NodeOptions, local: int, rendezvous: str, shared: SharedState,
                results: Any, control: Any) -> WorkerArgs:
    """What local worker ``local`` starts with (``rendezvous``: where the process group meets)."""
    return WorkerArgs(
        local_rank=local,
        gpu=local // setup.workers_per_gpu,
        shared_gpu=setup.workers_per_gpu > 1,
        rank=setup.ranks[local],
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
        control=control,
        parent_pid=os.getpid(),
        verify=options.verify,
        probe=options.probe,
        serve=None if options.serve is None else options.serve[local],
        dispatch=setup.dispatch,
    )


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
