"""Many VExpertDeployments at once against the API emulator: all reconcile, and at what cost.

Issue 8 ("many deployments at once in the emulator: all reconcile, operator memory and reconcile time
reported"). Runs the real operator (kopf ``--standalone`` in a thread, as the tests do) against the
project's API emulator (``tests/operator_support``), creates ``--n`` deployments at once (calibration
``skip``, one shared ``VExpertNodeProfile``, 2 node pods each), waits until every StatefulSet exists,
plays the kubelet (every node pod running and ready) and waits until every deployment is ``Running``.

Prints (and with ``--json`` appends one line to a JSONL file):

* seconds from the creates to all StatefulSets created, and to all deployments ``Running``;
* reconciles (by trigger), mean / p50 / p95 / max reconcile time, and API requests the operator made;
* memory: peak RSS of this process (``ru_maxrss``) and its growth during the run; with
  ``--emulator process`` the emulator runs in a child process, so this process is the operator plus
  the thin test driver, and the child's peak RSS is reported separately; ``--tracemalloc`` adds the
  Python heap peak (slows everything down ~2x, so timings of such a run are not comparable).

``--profile`` samples every thread's stack (``sys._current_frames``, every 5 ms) and prints the
hottest functions by self time and cumulative time, per thread (operator / emulator / driver): a
poor man's py-spy, which is not available here.

    python benchmarks/many_deployments.py --n 50                       # emulator in-process (as CI)
    python benchmarks/many_deployments.py --n 50 --emulator process    # emulator on its own core
    python benchmarks/many_deployments.py --n 20 --profile
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("tests", "operator", "runtime"):
    sys.path.insert(0, str(ROOT / sub))

import kopf  # noqa: E402
import pytest  # noqa: E402

from operator_support import harness  # noqa: E402
from operator_support.harness import Cluster, EmulatorServer, LoopThread  # noqa: E402
from test_operator_api import add_nodes, deployment  # noqa: E402
from vexpert_operator import kube  # noqa: E402
from vexpert_operator import naming as nm  # noqa: E402
from vexpert_operator.handlers import deployment as handlers  # noqa: E402

# ------------------------------------------------------------------------------ sampling profiler


class Sampler:
    """Samples every thread's Python stack; self and cumulative counts per thread role."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.self_counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.cum_counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    @staticmethod
    def _role(thread: threading.Thread | None) -> str:
        name = thread.name if thread is not None else "?"
        if name == "emulator-loop":
            return "emulator"
        if name == "MainThread":
            return "driver"
        if name == "sampler":
            return "sampler"
        return "operator" if "ThreadPool" not in name else "operator-executor"

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.period_s):
            threads = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                role = self._role(threads.get(ident))
                top = f"{frame.f_code.co_filename.rsplit('site-packages/', 1)[-1]}:{frame.f_code.co_name}"
                if top.endswith((":select", ":wait", ":_run_once")) and frame.f_code.co_name in ("select", "wait"):
                    role += "(idle)"
                self.samples[role] += 1
                self.self_counts[role][top] += 1
                seen = set()
                f: Any = frame
                while f is not None:
                    key = f"{f.f_code.co_filename.rsplit('site-packages/', 1)[-1]}:{f.f_code.co_name}"
                    if key not in seen:
                        seen.add(key)
                        self.cum_counts[role][key] += 1
                    f = f.f_back

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int = 25) -> str:
        lines = [f"samples per thread role: {dict(self.samples)}"]
        for role in sorted(self.self_counts):
            if role.endswith("(idle)") or role == "sampler":
                continue
            total = self.samples[role]
            lines.append(f"\n== {role}: {total} busy samples; self time")
            for key, n in self.self_counts[role].most_common(top):
                lines.append(f"  {100 * n / total:5.1f}%  {key}")
            lines.append(f"== {role}: cumulative")
            for key, n in self.cum_counts[role].most_common(top + 15):
                lines.append(f"  {100 * n / total:5.1f}%  {key}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- emulator


@contextlib.contextmanager
def emulator_in_process(tmp: Path) -> Iterator[tuple[str, LoopThread, Any]]:
    loop = LoopThread()
    server = EmulatorServer(loop).start()
    try:
        yield server.url, loop, server.emulator
    finally:
        server.stop()
        loop.stop()


@contextlib.contextmanager
def emulator_process(tmp: Path) -> Iterator[tuple[str, LoopThread, Any]]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-emulator"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    url = proc.stdout.readline().strip()
    loop = LoopThread()
    try:
        yield url, loop, proc
    finally:
        loop.stop()
        proc.stdin.close()
        proc.wait(30)


def serve_emulator() -> None:
    """Child process: the emulator until stdin closes; then prints its peak RSS (KiB) on stderr."""
    loop = LoopThread()
    server = EmulatorServer(loop).start()
    print(server.url, flush=True)
    sys.stdin.read()
    server.stop()
    loop.stop()
    print(json.dumps({"emulator_peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}),
          file=sys.stderr, flush=True)


def _vm_hwm_kib(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


# ------------------------------------------------------------------------------------------- run


def run(n: int, interval_s: float, mode: str, poll_s: float, timeout_s: float, profile: bool,
        trace_memory: bool) -> dict[str, Any]:
    durations: list[float] = []
    triggers: collections.Counter[str] = collections.Counter()
    requests: collections.Counter[str] = collections.Counter()
    real_reconcile = handlers.reconcile
    real_request = kube.KubeClient.request

    async def timed_reconcile(ctx: Any, body: Any, *, tune: bool = False) -> Any:
        start = time.perf_counter()
        try:
            return await real_reconcile(ctx, body, tune=tune)
        finally:
            durations.append(time.perf_counter() - start)

    async def counted_request(self: Any, method: str, path: str, **kw: Any) -> Any:
        if threading.current_thread().name != "emulator-loop" and self is not driver_client[0]:
            requests[method + (" list" if method == "GET" and kw.get("params") is not None else "")] += 1
        return await real_request(self, method, path, **kw)

    driver_client: list[Any] = [None]
    real_locked = handlers.locked_reconcile

    async def counted_locked(memo: Any, body: Any, logger: Any, trigger: str, tune: bool = False) -> Any:
        triggers[trigger] += 1
        return await real_locked(memo, body, logger, trigger, tune)

    mp = pytest.MonkeyPatch()
    mp.setattr(handlers, "reconcile", timed_reconcile)
    mp.setattr(handlers, "locked_reconcile", counted_locked)
    mp.setattr(kube.KubeClient, "request", counted_request)
    mp.setitem(harness.OPERATOR_ENV, "VEXPERT_OPERATOR_RECONCILE_INTERVAL_S", str(interval_s))
    sampler = Sampler() if profile else None
    result: dict[str, Any] = {"deployments": n, "reconcile_interval_s": interval_s, "emulator": mode,
                              "poll_s": poll_s, "tracemalloc": trace_memory, "cpus": os.cpu_count()}
    if trace_memory:
        import tracemalloc
        tracemalloc.start()
    try:
        with tempfile.TemporaryDirectory() as tmp, \
                (emulator_in_process if mode == "thread" else emulator_process)(Path(tmp)) as (url, loop, handle):
            server_stub = EmulatorServer(loop)
            server_stub.url = url
            mp.setenv("KUBECONFIG", str(server_stub.kubeconfig(Path(tmp) / "kubeconfig")))
            cluster = Cluster(loop, kopf.ConnectionInfo(server=url), f"vexpert-bench-{uuid.uuid4().hex[:6]}",
                              handle if mode == "thread" else None)
            driver_client[0] = cluster.client
            cluster.install_crds()
            cluster.create_namespace()
            type_name = add_nodes(cluster, 2)
            cluster.add_node_profile(type_name)
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            with harness.running_operator(cluster, mp):
                time.sleep(0.5)  # the operator is up and watching
                durations.clear()
                triggers.clear()
                requests.clear()
                if sampler:
                    sampler.start()
                t0 = time.monotonic()
                for i in range(n):
                    cluster.create(deployment(f"d{i:03d}", calibration__mode="skip"))
                t_created = time.monotonic() - t0
                cluster.wait_for(lambda: len(cluster.list_by(kube.STATEFULSETS, {nm.LABEL_COMPONENT: "node"})) == n
                                 or None, timeout=timeout_s, interval=poll_s, what=f"{n} StatefulSets")
                t_planned = time.monotonic() - t0
                pods = cluster.wait_for(lambda: (lambda ps: ps if len(ps) == 2 * n else None)(
                    [p for p in cluster.list_by(kube.PODS, {nm.LABEL_COMPONENT: "node"})
                     if not p["metadata"].get("deletionTimestamp")]), timeout=timeout_s, interval=poll_s,
                    what="every node pod")
                t_pods = time.monotonic() - t0
                for p in pods:
                    cluster.set_pod_running(p["metadata"]["name"])
                t_kubelet = time.monotonic() - t0
                cluster.wait_for(lambda: all((d.get("status") or {}).get("phase") == "Running"
                                             for d in cluster.list(kube.DEPLOYMENTS)) or None,
                                 timeout=timeout_s, interval=poll_s, what="every deployment Running")
                t_running = time.monotonic() - t0
                if sampler:
                    sampler.stop()
                reconciles, busy = len(durations), list(durations)
                by_trigger, reqs = dict(triggers), dict(requests)
                # Quiet period: with nothing changing, how much does the operator still do?
                quiet_s = min(interval_s * 1.5, 10.0)
                n_before = len(durations)
                r_before = collections.Counter(requests)
                time.sleep(quiet_s)
                quiet_reconciles = len(durations) - n_before
                quiet_requests = dict(collections.Counter(requests) - r_before)
            rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            assert all((d.get("status") or {}).get("phase") == "Running" for d in cluster.list(kube.DEPLOYMENTS))
            cluster.close()
            if mode == "process":
                result["emulator_peak_rss_mib"] = round((_vm_hwm_kib(handle.pid) or 0) / 1024, 1)
    finally:
        mp.undo()
    busy_sorted = sorted(busy)

    def pct(q: float) -> float:
        return round(1000 * busy_sorted[min(len(busy_sorted) - 1, int(q * len(busy_sorted)))], 1) if busy_sorted \
            else 0.0

    result.update({
        "creates_s": round(t_created, 2), "all_statefulsets_s": round(t_planned, 2),
        "all_pods_s": round(t_pods, 2), "pods_marked_ready_s": round(t_kubelet, 2),
        "all_running_s": round(t_running, 2),
        "reconciles": reconciles, "reconciles_by_trigger": by_trigger,
        "reconcile_ms_mean": round(1000 * statistics.fmean(busy), 1) if busy else 0.0,
        "reconcile_ms_p50": pct(0.5), "reconcile_ms_p95": pct(0.95), "reconcile_ms_max": pct(1.0),
        "api_requests": sum(reqs.values()), "api_requests_by_verb": reqs,
        "api_requests_per_reconcile": round(sum(reqs.values()) / max(reconciles, 1), 1),
        "quiet_s": quiet_s, "quiet_reconciles": quiet_reconciles, "quiet_api_requests": sum(quiet_requests.values()),
        "quiet_api_requests_by_verb": quiet_requests,
        "peak_rss_mib": round(rss1 / 1024, 1), "peak_rss_growth_mib": round((rss1 - rss0) / 1024, 1),
    })
    if trace_memory:
        import tracemalloc
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        result.update({"tracemalloc_current_mib": round(current / 2**20, 1),
                       "tracemalloc_peak_mib": round(peak / 2**20, 1)})
    if sampler:
        print(sampler.report(), file=sys.stderr)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50, help="deployments created at once")
    parser.add_argument("--interval", type=float, default=30.0, help="VEXPERT_OPERATOR_RECONCILE_INTERVAL_S")
    parser.add_argument("--emulator", choices=("thread", "process"), default="thread",
                        help="the emulator in a thread of this process (as the tests) or in a child process")
    parser.add_argument("--poll", type=float, default=0.5, help="the test driver's polling interval (s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per wait (s)")
    parser.add_argument("--profile", action="store_true", help="sample every thread's stack; print hot spots")
    parser.add_argument("--tracemalloc", action="store_true", help="also trace the Python heap (slower)")
    parser.add_argument("--json", type=Path, help="append the result as one JSON line")
    parser.add_argument("--label", default="", help="free text stored with the result")
    parser.add_argument("--serve-emulator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_emulator:
        serve_emulator()
        return 0
    result = run(args.n, args.interval, args.emulator, args.poll, args.timeout, args.profile, args.tracemalloc)
    if args.label:
        result["label"] = args.label
    result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as fh:
            fh.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
