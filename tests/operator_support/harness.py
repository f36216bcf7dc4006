"""Test harness: the API emulator in a thread, a synchronous cluster facade, the kubelet's part.

The same tests run against the emulator (default) or a real cluster (``KUBECONFIG`` set when the
test session starts). Everything the tests do goes through the Kubernetes API with the operator's
own client (``vexpert_operator.kube``): creating fake GPU nodes, completing calibration Jobs' pods
and marking node pods running/ready/crashed the way the kubelet reports them. On the emulator, its
StatefulSet and Job controllers create the pods; on a real cluster the real controllers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Coroutine, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.test_utils
import aiohttp.web_runner
import kmock
import kopf
import yaml

from vexpert_operator import kube
from vexpert_operator.crdgen import all_crds

from .emulator import KubeEmulator

T = TypeVar("T")
REAL_KUBECONFIG = os.environ.get("KUBECONFIG", "")  # captured before any test changes the environment
REPO = Path(__file__).resolve().parents[2]


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="emulator-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():  # a stuck loop (warned about by its user) is left to its daemon thread
            self.loop.close()


class _PromptlyStoppedServer(aiohttp.test_utils.RawTestServer):
    """kmock's test server with a short shutdown grace: aiohttp waits 60 s for open handlers by
    default, and one handler the emulator's stop did not end (a watch whose client vanished on a
    loaded CI machine) held the teardown past every timeout. After the grace they are cancelled."""

    SHUTDOWN_GRACE_S = 3.0

    async def _make_runner(self, debug: bool = True, **kwargs: Any) -> aiohttp.web_runner.ServerRunner:
        runner = await super()._make_runner(debug=debug, **kwargs)
        runner._shutdown_timeout = self.SHUTDOWN_GRACE_S  # BaseRunner's own field (its constructor argument)
        return runner


class EmulatorServer:
    """``KubeEmulator`` + ``kmock.Server`` on 127.0.0.1, in the loop thread."""

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.stack = contextlib.AsyncExitStack()
        self.emulator: KubeEmulator | None = None
        self.url = ""

    def start(self) -> EmulatorServer:
        async def _start() -> None:
            self.emulator = await self.stack.enter_async_context(KubeEmulator())
            server = await self.stack.enter_async_context(
                kmock.Server(self.emulator, server_cls=_PromptlyStoppedServer))
            self.url = str(server.url).rstrip("/")
        self.loop.run(_start())
        return self

    def stop(self) -> None:
        """End the watches and close the server. A shutdown that hangs (seen twice on a loaded CI
        host, never reproduced) is not what any test checks: after 20 s the loop's remaining tasks
        are cancelled and a warning names them — or, if the loop thread itself is stuck, its stack —
        instead of failing the teardown of a test that passed."""
        async def _close() -> None:
            if self.emulator is not None:
                await self.emulator.end_watches()
            await self.stack.aclose()

        async def _stop() -> None:
            try:
                await asyncio.wait_for(_close(), timeout=20)
            except asyncio.TimeoutError:
                alive = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                warnings.warn("emulator shutdown took > 20 s; cancelled its live tasks: " + "; ".join(
                    f"{t.get_name()} {t.get_coro()!r}" for t in alive)[:3000], stacklevel=1)
                for task in alive:
                    task.cancel()
        try:
            self.loop.run(_stop(), timeout=40)
        except TimeoutError:
            frame = sys._current_frames().get(self.loop.thread.ident or -1)
            warnings.warn("emulator loop thread stuck at shutdown:\n" + "".join(traceback.format_stack(frame))[-3000:],
                          stacklevel=1)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
        }))
        return path


class Cluster:
    """Synchronous facade over ``vexpert_operator.kube.KubeClient`` for tests."""

    def __init__(self, loop: LoopThread, connection: kopf.ConnectionInfo, namespace: str,
                 emulator: KubeEmulator | None = None) -> None:
        self.loop = loop
        self.client = kube.KubeClient(connection)
        self.namespace = namespace
        self.emulator = emulator
        self.created_nodes: list[str] = []

    @property
    def test_instance_type(self) -> str:
        """The instance-type label of this test's fake nodes (keeps their node types unique)."""
        return f"p5-test-{self.namespace[-6:]}"

    @property
    def emulated(self) -> bool:
        return self.emulator is not None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(coro)

    def close(self) -> None:
        self.run(self.client.close())

    # ----------------------------------------------------------------------------------- API

    def get(self, res: kube.Resource, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        return self.run(self.client.get_or_none(res, name, self._ns(res, namespace)))

    def list(self, res: kube.Resource, namespace: str | None = None, **labels: str) -> list[dict[str, Any]]:
        return self.run(self.client.list(res, self._ns(res, namespace), labels=labels or None))

    def list_by(self, res: kube.Resource, labels: Mapping[str, str], namespace: str | None = None
                ) -> list[dict[str, Any]]:
        return self.run(self.client.list(res, self._ns(res, namespace), labels=labels))

    def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        res = kube.KIND_TO_RESOURCE[body["kind"]]
        body = copy.deepcopy(dict(body))
        if res.namespaced:
            body.setdefault("metadata", {}).setdefault("namespace", self.namespace)
        return self.run(self.client.create(res, body))

    def patch(self, res: kube.Resource, name: str, patch: Mapping[str, Any], namespace: str | None = None,
              subresource: str | None = None) -> dict[str, Any]:
        return self.run(self.client.patch(res, name, patch, self._ns(res, namespace), subresource))

    def delete(self, res: kube.Resource, name: str, namespace: str | None = None) -> bool:
        return self.run(self.client.delete(res, name, self._ns(res, namespace)))

    def _ns(self, res: kube.Resource, namespace: str | None) -> str | None:
        return (namespace or self.namespace) if res.namespaced else None

    def wait_for(self, fn: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.05,
                 what: str = "condition") -> T:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = fn()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")

    def deployment(self, name: str) -> dict[str, Any]:
        obj = self.get(kube.DEPLOYMENTS, name)
        assert obj is not None, f"VExpertDeployment {name} is gone"
        return obj

    def status(self, name: str) -> dict[str, Any]:
        return self.deployment(name).get("status") or {}

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        for cond in self.status(name).get("conditions") or []:
            if cond["type"] == type_:
                return dict(cond)
        return {}

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        items = self.list(kube.EVENTS)
        return [e for e in items if reason is None or e.get("reason") == reason]

    # --------------------------------------------------------------------------- cluster setup

    def install_crds(self) -> None:
        for crd in all_crds().values():
            try:
                self.run(self.client.create(kube.CRDS, crd))
            except kube.ApiError as exc:
                if not exc.conflict:
                    raise
                live = self.run(self.client.get(kube.CRDS, crd["metadata"]["name"]))
                body = copy.deepcopy(crd)
                body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
                self.run(self.client.replace(kube.CRDS, body))

    def create_namespace(self) -> None:
        self.run(self.client.create(kube.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": self.namespace}}))

    def add_node_profile(self, type_name: str) -> dict[str, Any]:
        """A VExpertNodeProfile for this test's default GPU nodes (as if calibration had run)."""
        return self.create({"apiVersion": "vexpert.io/v1alpha1", "kind": "VExpertNodeProfile",
                            "metadata": {"name": type_name},
                            "spec": {"nodeType": {"gpuProduct": "NVIDIA-H200", "gpuCount": 8, "gpuMemoryMib": 143771,
                                                  "driverVersion": "550.54.15", "instanceType": self.test_instance_type},
                                     "profile": json.loads(profile_json())}})

    def add_gpu_node(self, name: str, product: str = "NVIDIA-H200", count: int = 8,
                     memory_mib: int = 143771, driver: str = "550.54.15", instance_type: str = "p5en.48xlarge",
                     allocatable_memory: str = "2000Gi", labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        node_labels = {
            "kubernetes.io/hostname": name,
            "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.count": str(count),
            "nvidia.com/gpu.memory": str(memory_mib),
            "nvidia.com/cuda.driver-version.full": driver,
            "node.kubernetes.io/instance-type": instance_type,
            "vexpert.io/test-node": "true",
            **(labels or {}),
        }
        node = self.run(self.client.create(kube.NODES, {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": node_labels},
            "spec": {"taints": [{"key": "vexpert.io/test-node", "value": "true", "effect": "NoSchedule"}]}}))
        self.created_nodes.append(name)
        resources = {"cpu": "192", "memory": allocatable_memory, "nvidia.com/gpu": str(count), "pods": "110"}
        return self.patch(kube.NODES, name, {"status": {
            "capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}],
        }}, subresource="status") or node

    # ------------------------------------------------------------------------- the kubelet's part

    def set_pod_running(self, name: str, ready: bool = True, ip: str = "127.0.0.1",
                        container: str = "node") -> dict[str, Any]:
        now = _now()
        return self.patch(kube.PODS, name, {"status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": now,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": now},
                {"type": "Ready", "status": str(ready), "lastTransitionTime": now},
            ],
            "containerStatuses": [{"name": container, "ready": ready, "restartCount": 0, "image": "x",
                                   "imageID": "", "started": True,
                                   "state": {"running": {"startedAt": now}}}],
        }}, subresource="status")

    def crash_pod(self, name: str, message: str = "NCCL error: unhandled system error", exit_code: int = 1,
                  container: str = "node") -> dict[str, Any]:
        """The container died and the kubelet restarted it in place (restartCount + 1)."""
        pod = self.get(kube.PODS, name)
        assert pod is not None
        restarts = 0
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs["name"] == container:
                restarts = int(cs.get("restartCount") or 0)
        now = _now()
        return self.patch(kube.PODS, name, {"status": {
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
            "containerStatuses": [{"name": container, "ready": False, "restartCount": restarts + 1, "image": "x",
                                   "imageID": "", "started": True, "state": {"running": {"startedAt": now}},
                                   "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error",
                                                                "message": message, "finishedAt": now}}}],
        }}, subresource="status")

    def job_pod(self, job: str) -> dict[str, Any] | None:
        pods = self.list_by(kube.PODS, {"batch.kubernetes.io/job-name": job})
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live[-1] if live else None

    def finish_job(self, job: str, message: str, exit_code: int = 0, container: str = "calibrate") -> None:
        """What the kubelet reports when the calibration container exits (termination message)."""
        pod = self.wait_for(lambda: self.job_pod(job), what=f"a pod of Job {job}")
        now = _now()
        self.patch(kube.PODS, pod["metadata"]["name"], {"status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
            "containerStatuses": [{"name": container, "ready": False, "restartCount": 0, "image": "x", "imageID": "",
                                   "state": {"terminated": {"exitCode": exit_code,
                                                            "reason": "Completed" if exit_code == 0 else "Error",
                                                            "message": message, "finishedAt": now}}}],
        }}, subresource="status")

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.client.delete(kube.NAMESPACES, self.namespace))
        for name in self.created_nodes:
            with contextlib.suppress(Exception):
                self.run(self.client.delete(kube.NODES, name))
        for profile in self.list(kube.NODE_PROFILES):
            if ((profile.get("spec") or {}).get("nodeType") or {}).get("instanceType") == self.test_instance_type:
                with contextlib.suppress(Exception):
                    self.run(self.client.delete(kube.NODE_PROFILES, profile["metadata"]["name"]))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@contextlib.contextmanager
def cluster_session(tmp_path: Path, monkeypatch: Any, real: bool = False) -> Iterator[Cluster]:
    """A fresh emulator, or (``real``) the cluster of ``$KUBECONFIG`` as it was when pytest started,
    with the CRDs installed and a new test namespace."""
    loop = LoopThread()
    server: EmulatorServer | None = None
    namespace = f"vexpert-test-{uuid.uuid4().hex[:6]}"
    try:
        if real:
            monkeypatch.setenv("KUBECONFIG", REAL_KUBECONFIG)
            connection = kube.connection_from_environment()
            cluster = Cluster(loop, connection, namespace)
        else:
            server = EmulatorServer(loop).start()
            monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
            cluster = Cluster(loop, kopf.ConnectionInfo(server=server.url), namespace, server.emulator)
        cluster.install_crds()
        cluster.create_namespace()
        try:
            yield cluster
        finally:
            if real:
                cluster.cleanup()
            cluster.close()
    finally:
        if server is not None:
            server.stop()
        loop.stop()


OPERATOR_ENV = {
    "VEXPERT_OPERATOR_RECONCILE_INTERVAL_S": "0.3",
    "VEXPERT_OPERATOR_METRICS_PORT": "0",
    "VEXPERT_OPERATOR_SCRAPE_TIMEOUT_S": "1",
    "VEXPERT_OPERATOR_WATCH_RECONNECT_S": "0.1",
    "VEXPERT_OPERATOR_CALIBRATION_RETRY_BACKOFF_S": "1",
    "VEXPERT_OPERATOR_CALIBRATION_MAX_RETRY_BACKOFF_S": "2",
}


@contextlib.contextmanager
def running_operator(cluster: Cluster, monkeypatch: Any, namespaces: list[str] | None = None,
                     env: Mapping[str, str] | None = None) -> Iterator[kopf.testing.KopfRunner]:
    """The real operator (kopf's CLI in a thread, ``--standalone``), watching the test namespace (or
    ``namespaces``); hardware calibration Jobs go to the test namespace."""
    from kopf.testing import KopfRunner

    settings = {**OPERATOR_ENV, "VEXPERT_OPERATOR_CALIBRATION_NAMESPACE": cluster.namespace, **(env or {})}
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    args = ["run", "--standalone", "-m", "vexpert_operator.main"]
    for namespace in namespaces or [cluster.namespace]:
        args += ["--namespace", namespace]
    with KopfRunner(args, timeout=30) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None, runner.output


class MetricsServer:
    """A node pod's Prometheus endpoint: serves whatever text the test sets."""

    def __init__(self) -> None:
        self.text = ""
        self.render: Callable[[], str] | None = None  # when set: the body, computed per request
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                body = (outer.render() if outer.render is not None else outer.text).encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def set(self, **gauges: float) -> None:
        self.text = "".join(f"# TYPE vexpert_{k} gauge\nvexpert_{k} {v}\n" for k, v in gauges.items())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def profile_json(bandwidth: float = 54.7, eta: float = 0.03, source: str = "hardware-calibration",
                 alpha: float = -0.75, beta: float = 0.53, intercept: float = 0.1) -> str:
    return json.dumps({
        "api_version": "vexpert.io/v1alpha1",
        "load_balance": {"alpha": alpha, "beta": beta, "intercept": intercept},
        "hardware": {"h2d_bandwidth_gb_per_s": bandwidth, "contention_eta": eta,
                     "compute_bound_tokens_per_expert": 160.0},
        "provenance": {"source": source, "created_at": "2026-11-30T12:00:00+00:00", "tool_version": "test"},
    })
