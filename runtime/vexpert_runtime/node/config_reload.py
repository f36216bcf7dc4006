"""Live retuning: the supervisor re-reads the config file's ``tuning`` section (k and Np) when the
file changes, checks the new values against the model and the host memory limit, and keeps the
running values when the file is bad (a half-written, invalid or unreadable file never stops a node)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vexpert_runtime.config import load_runtime_config
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.node.metrics import NodeMetrics
from vexpert_runtime.node.setup import NodeSetup, check_memory, check_pooled, memory_plan

CHECK_INTERVAL_S = 0.5  # how often the file's mtime is looked at


@dataclass(frozen=True)
class Tuning:
    """The knobs a running node takes from its config file: the allocation interval k and Np."""

    k: int
    pooled: int


def read_tuning(path: Path, setup: NodeSetup) -> Tuning:
    """The file's tuning, checked (raises on a bad file or values that do not fit)."""
    if not path.read_bytes().strip():  # a half-written file must not reset tuning to the defaults
        raise VExpertInputError("--config", f"{path} is empty")
    tuning = load_runtime_config(path).tuning
    pooled = tuning.pooled_experts or setup.spec.num_experts
    check_pooled(pooled, setup.spec.num_experts)
    memory = memory_plan(setup.spec, setup.torch_dtype, pooled, setup.slots, setup.world, setup.local_workers, setup.device)
    check_memory(memory, setup.host_memory_limit_bytes)
    return Tuning(tuning.allocation_interval, pooled)


class ConfigWatch:
    """Watches the config file's mtime (at most every ``CHECK_INTERVAL_S``); the first look only
    records it."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.last_check = 0.0
        self._mtime: int | None = None

    def changed(self) -> bool:
        """Whether the file changed since the last look (False when it is unreadable)."""
        now = time.monotonic()
        if self.path is None or now - self.last_check < CHECK_INTERVAL_S:
            return False
        self.last_check = now
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return False
        previous, self._mtime = self._mtime, mtime
        return previous is not None and mtime != previous


class ConfigReload:
    """The supervisor's reload check: the new tuning once the file changed to good values, counted
    in ``vexpert_config_reloads_total``; a bad file is counted in ``vexpert_config_reload_errors_total``,
    logged, and the running values kept."""

    def __init__(self, path: Path | None, setup: NodeSetup, metrics: NodeMetrics, log: Callable[[str], None]) -> None:
        self.watch = ConfigWatch(path)
        self.setup = setup
        self.metrics = metrics
        self.log = log

    def check(self, running: Tuning) -> Tuning | None:
        if not self.watch.changed():
            return None
        assert self.watch.path is not None
        try:
            tuning = read_tuning(self.watch.path, self.setup)
        except Exception as exc:  # a bad file (invalid values, not YAML, not UTF-8, unreadable) never stops the node
            self.metrics.reload_errors.inc()
            self.log(f"config reload rejected, keeping k={running.k} Np={running.pooled}: {exc}")
            return None
        if tuning != running:
            self.log(f"config reloaded: k {running.k} → {tuning.k}, Np {running.pooled} → {tuning.pooled}")
        self.metrics.reloads.inc()
        return tuning
