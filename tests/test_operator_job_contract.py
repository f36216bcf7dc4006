"""The calibration Jobs' command lines run the real `vexpert calibrate` (CPU twin here), and what the
container leaves as its termination message is what the operator harvests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from operator_support.samples import spec
from runtime_support import stop_process, wait_healthy
from vexpert_operator import manifests as mf
from vexpert_operator.calibration import JobSummary, failure_reason, parse_result
from vexpert_operator.settings import OperatorSettings
from vexpert_runtime.policy.profile import NodeTypeKey

KEY = NodeTypeKey(gpu_product="NVIDIA-H200", gpu_count=8, gpu_memory_mib=143771, driver_version="550.54.15")


def container_argv(job: dict, termination: Path, replace: dict[str, str]) -> list[str]:
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["vexpert", "calibrate"]
    args = list(c["args"])
    assert args[-2:] == ["--termination-message-path", mf.TERMINATION_LOG]
    args[-1] = str(termination)
    for i, arg in enumerate(args[:-1]):
        if arg in replace:
            args[i + 1] = replace[arg]
    return [sys.executable, "-m", "vexpert_runtime", "calibrate", *args]


def test_hardware_job_contract(tmp_path: Path) -> None:
    job = mf.build_hardware_calibration_job("ns", "t", KEY, 1, OperatorSettings())
    log = tmp_path / "termination-log"
    argv = [*container_argv(job, log, {"--gpus": "2"}), "--cpu", "--iters", "2"]  # the CPU twin on 2 ranks
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    profile = parse_result(log.read_text())
    assert profile.provenance.source == "hardware-calibration"
    assert profile.provenance.node_type == KEY
    assert profile.hardware.h2d_bandwidth_gb_per_s > 0


def test_hardware_job_failure_is_a_one_line_reason(tmp_path: Path) -> None:
    job = mf.build_hardware_calibration_job("ns", "t", KEY, 1, OperatorSettings())
    log = tmp_path / "termination-log"
    argv = [*container_argv(job, log, {"--node-type": "{not json"}), "--cpu"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode != 0
    message = log.read_text()
    assert "\n" not in message.strip() and "--node-type" in message
    pod = {"status": {"containerStatuses": [{"name": "calibrate", "state": {"terminated": {
        "exitCode": result.returncode, "message": message}}}]}}
    reason = failure_reason(pod, JobSummary("j", 1, "failed", None, "BackoffLimitExceeded"))
    assert reason.startswith(f"exit {result.returncode}: ") and "--node-type" in reason
    with pytest.raises(ValueError):
        parse_result(message)


def test_model_job_contract(tmp_path: Path) -> None:
    trace = tmp_path / "decode.npz"
    subprocess.run([sys.executable, "-m", "vexpert_runtime", "trace", "build", "--phase",
                    "bundled:decode_in1000out1000:40", "--gpus", "64", "-o", str(trace)],
                   check=True, capture_output=True, timeout=300)
    s = spec(calibration={"traces": ["traces/decode.npz"]})
    job = mf.build_model_calibration_job("ns", "k", 1, s, [], OperatorSettings())
    log = tmp_path / "termination-log"
    result = subprocess.run(container_argv(job, log, {"--trace": str(trace)}), capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    profile = parse_result(log.read_text())
    assert profile.provenance.source == "model-calibration"
    assert profile.provenance.model == "deepseek-ai/DeepSeek-V3" and profile.provenance.model_revision == "r1"
    assert -10 <= profile.load_balance.alpha <= 10


def test_node_runtime_accepts_the_rendered_config_and_its_metrics_parse(tmp_path: Path) -> None:
    """`vexpert node` (CPU workers, built-in demo model) runs on the operator's RuntimeConfig and its
    Prometheus endpoint is what the tuning loop reads."""
    import time
    import urllib.request

    from vexpert_operator.plan import PlanInputs, plan_group
    from vexpert_operator.tuning import aggregate, parse_runtime_metrics
    from vexpert_runtime.ports import free_port

    port = free_port()
    s = spec(model={"name": "demo", "architecture": "deepseek_v3", "checkpoint": {"hostPath": "/models"}},
             parallelism={"expertParallelSize": 2, "gpusPerNode": 2})
    config = plan_group(PlanInputs(name="d", namespace="ns", spec=s)).runtime_config
    # What differs on this machine: no checkpoint (the demo model), CPU, loopback rendezvous.
    config.model.checkpoint_path = ""
    config.runtime.device = "cpu"
    config.runtime.metrics_port = port
    config.parallelism.master_addr = "127.0.0.1"
    config.parallelism.master_port = free_port()  # not the in-cluster default 29500: another run may hold it
    config.tuning.pooled_experts = None
    path = tmp_path / "runtime.yaml"
    path.write_text(config.to_yaml())
    proc = subprocess.Popen([sys.executable, "-m", "vexpert_runtime", "node", "--config", str(path),
                             "--cpu-workers", "2", "--iterations", "100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        values: dict[str, float] = {}
        deadline = time.monotonic() + 90
        wanted = {"vexpert_step_seconds", "vexpert_allocator_seconds", "vexpert_balance_ratio"}
        while time.monotonic() < deadline and not (wanted <= values.keys()
                                                   and values.get("vexpert_tokens_per_second", 0) > 0):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                values = parse_runtime_metrics(body)
            except OSError:
                pass
            time.sleep(0.5)
        sample = aggregate([values])
        assert sample.reported_k == {10}
        assert sample.balance_ratio is not None and 0 < sample.balance_ratio <= 1
        assert sample.tokens_per_second is not None and sample.tokens_per_second > 0
        assert sample.allocator_share is not None and sample.degraded_pods == 0
    finally:
        stop_process(proc, 20)


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # spec.runtime.chatTemplate: the contents alone


def test_node_pod_command_serves_the_api_on_the_rendered_config(tmp_path: Path) -> None:
    """The node pod's own command (`vexpert serve --config … --port … --api-servers 2 --stream-interval 2
    --scheduling-policy priority --prefix-caching --seed 7 --enforce-eager --enable-log-requests
    --max-model-len 1024 --max-num-seqs 8 --max-num-batched-tokens 64
    --max-waiting 16 --tool-call-parser hermes --reasoning-parser deepseek_r1 --chat-template
    …`, CPU workers, the embedded demo model) on the operator's
    RuntimeConfig: /health turns 200, /v1/models names the context, a completion is served, and /metrics (on either API server) carries the serving series
    the tuning loop reads next to the node's."""
    import json
    import os
    import time
    import urllib.request

    from vexpert_operator.manifests import build_pod_template
    from vexpert_operator.plan import PlanInputs, plan_group
    from vexpert_operator.tuning import parse_runtime_metrics
    from vexpert_runtime.ports import free_port

    s = spec(model={"name": "demo", "architecture": "deepseek_v3", "checkpoint": {"hostPath": "/models"}},
             parallelism={"expertParallelSize": 2, "gpusPerNode": 2}, runtime__apiServers=2, runtime__streamInterval=2,
             runtime__schedulingPolicy="priority", runtime__prefixCaching=True, runtime__seed=7,
             runtime__enforceEager=True, runtime__logRequests=True, runtime__maxModelLen=1024,
             runtime__maxNumSeqs=8, runtime__maxNumBatchedTokens=64, runtime__maxWaiting=16, runtime__toolCallParser="hermes",
             runtime__reasoningParser="deepseek_r1", runtime__chatTemplate=TEMPLATE)
    group = plan_group(PlanInputs(name="d", namespace="ns", spec=s))
    config = group.runtime_config
    config.model.checkpoint_path = ""
    config.model.dtype = "float32"
    config.runtime.device = "cpu"
    config.parallelism.master_addr = "127.0.0.1"
    config.parallelism.master_port = free_port()
    config.tuning.pooled_experts = None
    path = tmp_path / "runtime.yaml"
    path.write_text(config.to_yaml())
    container = build_pod_template("d", s, group.sizing, "h", None)["spec"]["containers"][0]
    assert container["command"] == ["vexpert", "serve"]
    assert container["args"][4:] == ["--api-servers", "2", "--stream-interval", "2",
                                     "--scheduling-policy", "priority", "--prefix-caching", "--seed", "7",
                                     "--enforce-eager", "--enable-log-requests", "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                                     "--max-waiting", "16", "--tool-call-parser", "hermes",
                                     "--reasoning-parser", "deepseek_r1", "--chat-template", TEMPLATE]
    port = free_port()
    args = [str(path) if a == "/etc/vexpert/runtime.yaml" else a for a in container["args"]]
    args[args.index("--port") + 1] = str(port)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    log = tmp_path / "serve.log"  # a file, not a pipe nobody reads while the server runs (it could fill and block)
    proc = subprocess.Popen([sys.executable, "-m", "vexpert_runtime", "serve", *args, "--cpu-workers", "2"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log, 120)
        models = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=5).read())
        assert models["data"][0]["max_model_len"] == 1024  # the demo checkpoint's own is 4096
        assert "engine seed 7" in log.read_text()
        body = json.dumps({"model": "vexpert-demo", "prompt": "Hello", "max_tokens": 4, "priority": -1}).encode()
        request = urllib.request.Request(base + "/v1/completions", data=body, headers={"content-type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert answer["usage"]["completion_tokens"] >= 1
        assert f"request {answer['id']}: /v1/completions" in log.read_text()  # --enable-log-requests
        tokens = []  # the chat template of the spec renders a chat as its messages' contents alone
        for body in ({"messages": [{"role": "user", "content": "Hello there"}]},
                     {"prompt": "Hello there", "add_special_tokens": False}):
            request = urllib.request.Request(base + "/tokenize", data=json.dumps(body).encode(),
                                             headers={"content-type": "application/json"})
            tokens.append(json.loads(urllib.request.urlopen(request, timeout=10).read())["tokens"])
        assert tokens[0] == tokens[1] and tokens[0]
        deadline = time.monotonic() + 10  # either server answers; the other's series are ≤ 1 s old there
        while True:
            values = parse_runtime_metrics(urllib.request.urlopen(base + "/metrics", timeout=5).read())
            if values.get("vexpert_serve_generated_tokens_total", 0) >= 1 and "vexpert_step_seconds" in values:
                break
            assert time.monotonic() < deadline, values
            time.sleep(0.3)
    finally:
        stop_process(proc, 30)


def test_scrape_reads_a_body_that_arrives_in_pieces() -> None:
    """A node pod's /metrics (~15 KB for 58 layers) arrives in several TCP segments on a real
    network; the operator must parse all of it, not what had arrived at the first read."""
    import asyncio
    import socket
    import threading
    import time

    import aiohttp

    from vexpert_operator.reconciler import _scrape_one
    from vexpert_operator.tuning import parse_runtime_metrics
    from vexpert_runtime.node.metrics import NodeMetrics

    metrics = NodeMetrics(58)
    metrics.set_layers(metrics.balance, [0.9] * 58)
    metrics.allocation_interval.set(16)
    metrics.degraded.set(1)
    body = metrics.render().encode()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % len(body))
        cut = body.index(b"vexpert_allocation_interval 16") + len("vexpert_allocation_interval 1")
        conn.sendall(body[:cut])  # stops inside "16"
        time.sleep(0.1)
        conn.sendall(body[cut:])
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def scrape() -> dict[str, float] | None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            return await _scrape_one(session, f"http://127.0.0.1:{port}/metrics", 512 * 1024)

    try:
        got = asyncio.run(scrape())
    finally:
        thread.join(timeout=5)
        server.close()
    assert got == parse_runtime_metrics(body)
    assert got["vexpert_allocation_interval"] == 16 and got["vexpert_degraded"] == 1
