"""The tuning loop's contract with the node runtime: a real `vexpert node` (CPU workers, built-in demo
model) on the operator's config answers its readiness endpoint, and what its /metrics says goes
through the operator's parser and tuner to a decision made on all four inputs. (Node pods run
`vexpert serve` on the same config, which answers the pod's probe, GET /health on the `http` port, and
exports these series with its own on that port.)"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from operator_support.samples import spec
from runtime_support import stop_process
from vexpert_operator.plan import PlanInputs, plan_group
from vexpert_operator.tuning import TuningState, aggregate, decide_tuning, parse_runtime_metrics
from vexpert_runtime.node.setup import memory_plan
from vexpert_runtime.simulation.workload import demo_model_spec

PRESSURE = 0.994  # the host memory limit is set so that the pinned bytes fill 99.4% of it
POOLED = 8  # Np < E = 32: the hit ratio is measured


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_every_input_the_tuner_reads_is_a_runtime_metric() -> None:
    """Names must match exactly: each gauge the parser knows (but the optional after-allocation
    balance, which the runtime replaces by ``vexpert_balance_decay``) is in the node's registry."""
    from vexpert_operator.tuning import KNOWN_GAUGES
    from vexpert_runtime.node.metrics import NodeMetrics

    exported = {family.name for family in NodeMetrics(num_layers=2).registry.collect()}
    assert set(KNOWN_GAUGES) - exported == {"vexpert_balance_ratio_after_allocation"}


def test_tuner_decides_on_a_real_nodes_metrics(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = spec(model={"name": "demo", "architecture": "deepseek_v3", "checkpoint": {"hostPath": "/models"}},
             parallelism={"expertParallelSize": 2, "gpusPerNode": 2})
    plan = plan_group(PlanInputs(name="d", namespace="ns", spec=s))
    container = plan.statefulset["spec"]["template"]["spec"]["containers"][0]
    probe = container["readinessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe == {"path": "/health", "port": "http"}
    assert container["command"] == ["vexpert", "serve"] and container["args"][-2:] == ["--port", str(ports["http"])]
    assert plan.runtime_config.runtime.metrics_port == 0  # one port: serve's; no separate node endpoint
    assert {"VEXPERT_NODE_RANK", "VEXPERT_POD_NAME"} <= {e["name"] for e in container["env"]}

    config = plan.runtime_config.model_copy(deep=True)
    # What differs on this machine: the demo model, CPU, loopback rendezvous, a free port, a small pool.
    config.model.checkpoint_path = ""
    config.runtime.device = "cpu"
    config.runtime.metrics_port = port
    config.parallelism.master_addr = "127.0.0.1"
    config.tuning.pooled_experts = POOLED
    model = demo_model_spec()
    need = memory_plan(model, getattr(torch, config.model.dtype), POOLED, config.vexpert.group_size * config.vexpert.vmax,
                       2, 2, "cpu").host_bytes
    config.runtime.host_memory_limit_bytes = math.ceil(need / PRESSURE)
    path = tmp_path / "runtime.yaml"
    path.write_text(config.to_yaml())
    # A pod of a Kubernetes < 1.28 cluster: no pod-index label, so VEXPERT_NODE_RANK is empty.
    env = {**os.environ, "VEXPERT_NODE_RANK": "", "VEXPERT_POD_NAME": plan.statefulset["metadata"]["name"] + "-0"}
    proc = subprocess.Popen([sys.executable, "-m", "vexpert_runtime", "node", "--config", str(path),
                             "--cpu-workers", "2", "--iterations", "100000", "--tokens-per-worker", "16"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    wanted = {"vexpert_balance_decay", "vexpert_pool_hit_ratio", "vexpert_pinned_memory_pressure",
              "vexpert_allocator_seconds", "vexpert_step_seconds", "vexpert_balance_ratio"}
    try:
        probes: list[tuple[int, str]] = []
        values: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (wanted <= values.keys()):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                probes.append(_get(base + "/ready"))
                if probes[-1][0] == 200:
                    with urllib.request.urlopen(f"{base}/metrics", timeout=2) as response:
                        values = parse_runtime_metrics(response.read())
            except OSError:  # not listening yet
                pass
            time.sleep(0.2)
        assert wanted <= values.keys(), sorted(values)  # (stderr is read once the node stopped: it is still running)
    finally:
        stop_process(proc, 20)
    # readiness: 503 with a one-line reason until ready, then 200
    assert probes[-1] == (200, "ready\n")
    assert all(code == 503 and body.startswith("not ready: ") and body.count("\n") == 1
               for code, body in probes[:-1] if code != 200)

    sample = aggregate([values])
    assert sample.reported_k == {plan.allocation_interval} and sample.reported_np == {POOLED}
    assert sample.memory_pressure is not None and abs(sample.memory_pressure - PRESSURE) < 1e-3
    assert sample.pool_hit_ratio is not None and 0 <= sample.pool_hit_ratio <= 1
    assert sample.balance_decay is not None and sample.allocator_share is not None and sample.degraded_pods == 0
    k_spec = s.vexpert.allocation_interval
    state = TuningState(allocation_interval=plan.allocation_interval, pooled_experts=POOLED, k_mode="auto",
                        k_min=k_spec.min, k_max=k_spec.max, np_mode="auto", np_min=2, np_cap=POOLED)
    decision = decide_tuning(state, sample)
    assert decision.np_changed and decision.pooled_experts == 6, decision.reason  # 95% > 90%: Np × 0.8
    assert "pinned memory pressure 99%" in decision.reason
    assert "no balance-decay or allocator-time data" not in decision.reason  # k was judged on real data
