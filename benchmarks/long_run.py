"""Long run of the demo model on CPU workers: memory must stay flat.

Runs ``--iterations`` (default 10,000) decode iterations of the built-in demo model on 2 CPU
workers (gloo, shared-memory slots) with a new plan every ``--k`` iterations (the allocator runs on
every window), and after every window samples

* the resident memory (VmRSS) of the coordinator and of each worker,
* /dev/shm: entries and bytes used,
* the shared-memory file descriptors the coordinator and workers hold (torch's CPU shared tensors
  are unlinked /dev/shm files or memfds: they never show in /dev/shm, only as open descriptors).

After a warm-up (the first ``--warmup`` fraction of the samples) the shared-memory counts must not
grow at all and RSS may grow by at most ``--rss-slack-mb`` per process; the script exits 1 (and
prints why) otherwise. The node keeps ``--keep-history`` iterations of records (default 1,000 here,
10,000 in a node) so that the run reaches the steady state a node running until SIGTERM lives in. ``--json PATH`` writes the samples and the verdict.

    python benchmarks/long_run.py                      # 10,000 iterations
    python benchmarks/long_run.py --iterations 150 --k 5   # what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from vexpert_runtime.config import RuntimeConfig  # noqa: E402
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint  # noqa: E402
from vexpert_runtime.node import NodeOptions, NodeRuntime, Progress, resolve_setup  # noqa: E402
from vexpert_runtime.ports import free_port  # noqa: E402
from vexpert_runtime.shm_names import name_semaphores_by_run, run_semaphore_prefix  # noqa: E402
from vexpert_runtime.simulation.workload import demo_model_spec  # noqa: E402
from vexpert_runtime.workload import Workload  # noqa: E402

SHM_MARKERS = ("/dev/shm/", "memfd:", "torch_")


@dataclass
class Sample:
    iteration: int
    coordinator_rss: int
    worker_rss: list[int]
    shm_entries: int
    shm_bytes: int
    shm_fds: int


@dataclass
class LongRunResult:
    iterations: int
    seconds: float
    plan_switches: int
    degraded_groups: int
    records_kept: int = 0
    samples: list[Sample] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _rss(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (the workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return sorted(found)


def _shm_fds(pid: int) -> int:
    count = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if any(marker in target for marker in SHM_MARKERS):
            count += 1
    return count


def _shm_usage(pids: list[int]) -> tuple[int, int]:
    """The run's /dev/shm entries (its named semaphores, torch's shared files of its processes) and
    the bytes /dev/shm holds in all. /dev/shm is machine-wide: other programs' entries (a parallel
    test, another job) come and go, and only the run's own are counted."""
    if not os.path.isdir("/dev/shm"):
        return 0, 0
    prefixes = (run_semaphore_prefix(os.getpid()), *(f"torch_{pid}_" for pid in pids))
    entries = [name for name in os.listdir("/dev/shm") if name.startswith(prefixes)]
    stat = os.statvfs("/dev/shm")
    return len(entries), (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def sample(iteration: int) -> Sample:
    me = os.getpid()
    workers = _children(me)
    rss = []
    for pid in workers:
        try:
            rss.append(_rss(pid))
        except OSError:
            rss.append(0)
    entries, used = _shm_usage([me, *workers])
    return Sample(iteration, _rss(me), rss, entries, used, _shm_fds(me) + sum(_shm_fds(p) for p in workers))


def check(samples: list[Sample], warmup: float, rss_slack_bytes: int) -> list[str]:
    """What is wrong with the samples after warm-up (empty: memory is flat)."""
    if len(samples) < 3:
        return [f"only {len(samples)} samples"]
    steady = samples[max(1, int(len(samples) * warmup)) :]
    first, problems = steady[0], []
    if max(s.shm_fds for s in steady) > first.shm_fds:  # (the last window may see workers already closing)
        problems.append(f"shared-memory descriptors grew from {first.shm_fds} to {max(s.shm_fds for s in steady)}")
    # the run's own /dev/shm entries (see _shm_usage): only growth counts
    if max(s.shm_entries for s in steady) > first.shm_entries:
        problems.append(f"/dev/shm entries grew from {first.shm_entries} to {max(s.shm_entries for s in steady)}")
    grew = max(s.coordinator_rss for s in steady) - first.coordinator_rss
    if grew > rss_slack_bytes:
        problems.append(f"coordinator RSS grew by {grew / 2**20:.1f} MiB (allowed {rss_slack_bytes / 2**20:.1f})")
    for w in range(len(first.worker_rss)):
        grew = max(s.worker_rss[w] for s in steady if w < len(s.worker_rss)) - first.worker_rss[w]
        if grew > rss_slack_bytes:
            problems.append(f"worker {w} RSS grew by {grew / 2**20:.1f} MiB (allowed {rss_slack_bytes / 2**20:.1f})")
    return problems


def run_long(
    iterations: int = 10_000,
    k: int = 10,
    workers: int = 2,
    tokens_per_worker: int = 16,
    warmup: float = 0.2,
    rss_slack_mb: float = 16.0,
    log: Any = None,
    keep_history: int = 10_000,
) -> LongRunResult:
    """Run the demo model for ``iterations`` with a plan every ``k`` and check memory stays flat."""
    with tempfile.TemporaryDirectory(prefix="vexpert-long-run-") as tmp:
        spec = demo_model_spec()
        checkpoint = write_tiny_checkpoint(Path(tmp) / "demo-model", spec, seed=0)
        config = RuntimeConfig.model_validate(
            {
                "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
                "parallelism": {"expert_parallel_size": workers, "gpus_per_node": workers, "master_port": free_port()},
                "vexpert": {"group_size": 2, "vmax": 2, "balance_threshold": 0.95},
                "tuning": {"allocation_interval": k},
                "runtime": {"device": "cpu", "cpu_workers": workers, "metrics_port": 0, "slot_fill_timeout_s": 5.0},
            }
        )
        setup = resolve_setup(config, checkpoint)
        samples: list[Sample] = []
        plans: set[int] = set()

        def progress(p: Progress) -> None:
            plans.add(p.plan_id)
            samples.append(sample(p.iteration))
            if log is not None and len(samples) % 100 == 0:
                s = samples[-1]
                log(f"iter {p.iteration}: coordinator {s.coordinator_rss / 2**20:.1f} MiB, workers "
                    f"{[round(r / 2**20, 1) for r in s.worker_rss]} MiB, shm fds {s.shm_fds}, /dev/shm {s.shm_entries}")

        options = NodeOptions(
            workload=Workload(tokens_per_worker=tokens_per_worker, seed=0),
            iterations=iterations,
            progress=progress,
            keep_history=keep_history,
        )
        # name the run's semaphores after this process, as `vexpert` does, so that only they are counted;
        # the caller's own setting comes back afterwards (a test process runs other nodes after this one)
        mp_config = getattr(multiprocessing.current_process(), "_config", {})
        previous_prefix = mp_config.get("semprefix")
        name_semaphores_by_run()
        try:
            started = time.monotonic()
            report = NodeRuntime(setup, options).run()
            elapsed = time.monotonic() - started
        finally:
            if previous_prefix is not None:
                mp_config["semprefix"] = previous_prefix
    result = LongRunResult(report.iterations, elapsed, len(plans) - 1, report.degraded_groups, len(report.records), samples)
    result.problems = check(samples, warmup, int(rss_slack_mb * 2**20))
    if report.iterations != iterations:
        result.problems.append(f"ran {report.iterations} of {iterations} iterations")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--k", type=int, default=10, help="allocation interval: a new plan every k iterations")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens-per-worker", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of samples ignored at the start")
    parser.add_argument("--rss-slack-mb", type=float, default=16.0, help="RSS growth allowed per process after warm-up")
    parser.add_argument(
        "--keep-history", type=int, default=1000, help="iterations of history the node keeps (NodeOptions.keep_history)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write samples and verdict here")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run_long(
        args.iterations, args.k, args.workers, args.tokens_per_worker, args.warmup, args.rss_slack_mb, log, args.keep_history
    )
    first, last = result.samples[0], result.samples[-1]
    summary = {
        "iterations": result.iterations,
        "seconds": round(result.seconds, 1),
        "plan_switches": result.plan_switches,
        "degraded_groups": result.degraded_groups,
        "records_kept": result.records_kept,
        "coordinator_rss_mib": [round(first.coordinator_rss / 2**20, 1), round(last.coordinator_rss / 2**20, 1)],
        "worker_rss_mib": [[round(r / 2**20, 1) for r in first.worker_rss], [round(r / 2**20, 1) for r in last.worker_rss]],
        "shm_fds": [first.shm_fds, last.shm_fds],
        "shm_entries": [first.shm_entries, last.shm_entries],
        "ok": result.ok,
        "problems": result.problems,
    }
    print(json.dumps(summary))
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "samples": [asdict(s) for s in result.samples]}, indent=1))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
