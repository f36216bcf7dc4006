"""What the supervisor saw of a run, iteration by iteration (:class:`RunHistory`), and the
:class:`~vexpert_runtime.node.report.NodeReport` composed from it at the end (:func:`compose_report`)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np

from vexpert_runtime.node.balance import BalanceState, WindowBalance
from vexpert_runtime.node.messages import IterationDone
from vexpert_runtime.node.plans import PlanSwitch
from vexpert_runtime.node.report import IterationRecord, NodeReport

RATE_HORIZON_S = 2.0  # tokens/s gauge: averaged over at least this much recent time


class RunHistory:
    """Per-iteration records (as the workers reported them and the windows measured them), the
    iterations completed, the clocks and the largest verified error.

    ``workers``: local workers (an iteration is complete once each reported it); ``tokens_per_iteration``:
    tokens the whole EP group runs per iteration."""

    def __init__(self, workers: int, tokens_per_iteration: int) -> None:
        self.workers = workers
        self.tokens_per_iteration = tokens_per_iteration
        self.records: dict[int, IterationRecord] = {}
        self.completed = 0  # iterations every local worker finished
        self.graphed_steps = 0
        self.degraded_total = 0
        self.max_error: float | None = None
        self.near_tie_tokens = 0  # verified tokens left out at a routing tie (low precision)
        self.started_at: float | None = None
        self.last_iter_at: float | None = None
        self._rate_marks: collections.deque[tuple[float, int]] = collections.deque()  # (time, iterations)

    def record(self, iteration: int) -> IterationRecord:
        return self.records.setdefault(iteration, IterationRecord(iteration))

    def workers_ready(self) -> None:
        """Every local worker loaded the model: the run's clock starts."""
        self.started_at = time.perf_counter()

    def on_iteration(self, msg: IterationDone) -> IterationRecord:
        """Fold one worker's report of an iteration into its record (complete once every local
        worker reported: ``record.reports == workers``)."""
        record = self.record(msg.iteration)
        record.step_s = max(record.step_s, msg.step_s)
        record.wait_s = max(record.wait_s, msg.wait_s)
        record.degraded_groups = max(record.degraded_groups, msg.degraded_layers)
        record.plan_ids = msg.plan_ids
        record.reports += 1
        if msg.details is not None:
            record.details[msg.rank] = msg.details
        if msg.graphed:
            self.graphed_steps += 1
        if record.reports == self.workers:
            self.last_iter_at = time.perf_counter()
            self.completed += 1
            self.degraded_total += record.degraded_groups
        return record

    def on_window(self, balance: WindowBalance) -> list[IterationRecord]:
        """Set the window's iterations' balances; their records."""
        static, measured = balance.static.mean(1).tolist(), balance.measured.mean(1).tolist()
        for i in range(len(static)):
            record = self.record(balance.start + i)
            record.static_balance = static[i]
            record.vexpert_balance = measured[i]
        return [self.records[i] for i in range(balance.start, balance.end) if i in self.records]

    def on_error(self, iteration: int, error: float, near_ties: int = 0) -> None:
        """A verified output of ``iteration`` was off the reference by ``error`` (relative), over
        its tokens but ``near_ties`` left out at a routing tie."""
        self.near_tie_tokens += near_ties
        record = self.records[iteration]
        record.rel_error = max(record.rel_error or 0.0, error)
        self.max_error = max(self.max_error or 0.0, error)

    def recent_rate(self, iterations_done: int) -> float:
        """Tokens/s over the last ≥ RATE_HORIZON_S of windows. Windows often reach the supervisor
        in one batch, microseconds apart, so the time between two of them says nothing."""
        now = time.perf_counter()
        marks = self._rate_marks
        if not marks:
            marks.append((self.started_at or now, 0))
        marks.append((now, iterations_done))
        while len(marks) > 2 and now - marks[1][0] >= RATE_HORIZON_S:
            marks.popleft()  # keep the newest mark that is still ≥ the horizon old
        (t0, i0), (t1, i1) = marks[0], marks[-1]
        if t1 <= t0:
            return 0.0
        return (i1 - i0) * self.tokens_per_iteration / (t1 - t0)

    def prune(self, keep: int) -> bool:
        """Keep the last ``keep`` iterations' records; whether it pruned (once ``keep`` is exceeded by
        a tenth, so pruning is rare)."""
        if len(self.records) <= keep + keep // 10:
            return False
        for iteration in sorted(self.records)[: len(self.records) - keep]:
            del self.records[iteration]
        return True

    @property
    def elapsed_s(self) -> float:
        return (self.last_iter_at or 0.0) - (self.started_at or 0.0)


@dataclass(frozen=True)
class RunTotals:
    """What the report takes from outside the history: the coordinator's fills, the plan switches
    it made, the memory and the metrics."""

    bytes_streamed: int
    copy_s: float
    plan_switches: list[PlanSwitch]
    slot_bytes_per_worker: int
    pool_bytes: int
    metrics_port: int | None
    metrics_text: str
    dispatch: str


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def compose_report(history: RunHistory, balance: BalanceState, totals: RunTotals) -> NodeReport:
    """The summary of a finished run."""
    records = [history.records[i] for i in sorted(history.records)]
    elapsed = history.elapsed_s
    return NodeReport(
        iterations=history.completed,
        static_balance=_mean([r.static_balance for r in records if r.static_balance is not None]),
        vexpert_balance=_mean([r.vexpert_balance for r in records if r.vexpert_balance is not None]),
        tokens_per_s=history.completed * history.tokens_per_iteration / elapsed if elapsed > 0 else 0.0,
        max_rel_error=history.max_error,
        slot_bytes_per_worker=totals.slot_bytes_per_worker,
        pool_bytes=totals.pool_bytes,
        bytes_streamed=totals.bytes_streamed,
        plan_switches=list(totals.plan_switches),
        allocations=balance.allocations,
        allocator_s=list(balance.allocator_s),
        degraded_groups=history.degraded_total,
        graphed_steps=history.graphed_steps,
        metrics_port=totals.metrics_port,
        records=records,
        metrics_text=totals.metrics_text,
        pooled=int(balance.pool_experts.shape[1]),
        k=balance.k,
        windows=list(balance.windows),
        tables=dict(balance.tables),
        plan_pools=dict(balance.plan_pools),
        copy_s=totals.copy_s,
        dispatch=totals.dispatch,
        verify_near_ties=history.near_tie_tokens,
    )
