"""Node lifecycle and entry points: ``vexpert demo`` end to end, the metrics endpoint, config
reload of k and Np, bad input (one error line, exit 2, nothing left running) and shutdown on
SIGTERM / coordinator death without orphan processes or leaked shared memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from runtime_support import TINY_DEEPSEEK_SPEC
from shm_support import (
    assert_run_has_named_semaphores,
    assert_run_left_nothing,
    noise_created_since,
    other_programs_semaphores,
)
from slot_audit import SlotAudit
from vexpert_runtime import cli
from vexpert_runtime.config import load_runtime_config
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import expert_tensor, write_tiny_checkpoint
from vexpert_runtime.node import (
    NodeOptions,
    NodeRuntime,
    Progress,
    resolve_setup,
    run_node,
)
from vexpert_runtime.node.messages import CountsWindow, IterationDone, WorkerDone, WorkerReady
from vexpert_runtime.node.setup import resolve_node_rank
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload

REPO = Path(__file__).resolve().parents[1]
SPEC = TINY_DEEPSEEK_SPEC



def _config(path: Path, checkpoint: Path | str, **sections: dict[str, Any]) -> Path:
    raw: dict[str, Any] = {
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95},
        "tuning": {"allocation_interval": 4},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    path.write_text(yaml.safe_dump(raw))
    return path


def _marked_processes(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker`` (children of a CLI run included)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "State:\tZ" not in status:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _env(marker: str) -> dict[str, str]:
    return {**os.environ, "VEXPERT_TEST_MARKER": marker, "PYTHONUNBUFFERED": "1"}


def _vexpert(*args: str) -> list[str]:
    return [sys.executable, "-m", "vexpert_runtime", *args]


def _assert_nothing_left(marker: str, shm_before: set[str], root_pid: int, pids: Sequence[int] = (),
                         within_s: float = 5.0) -> None:
    """No process of the run alive, no shared-memory object of the run (``root_pid``: its ``vexpert``
    process; ``pids``: its processes) left; other programs' objects are not counted."""
    deadline = time.monotonic() + within_s
    while _marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked_processes(marker) == [], "processes of the run are still alive"
    assert_run_left_nothing(root_pid, pids, shm_before)


# ------------------------------------------------------------------------------------------------
# vexpert demo
# ------------------------------------------------------------------------------------------------


def test_demo_shows_vexpert_beating_static_and_verifies() -> None:
    marker = uuid.uuid4().hex
    shm_before = _shm()
    started = time.monotonic()
    proc = subprocess.Popen(
        _vexpert("demo", "--iterations", "40", "--verify", "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(marker),
        cwd=REPO,
    )
    done = subprocess.CompletedProcess(proc.args, 0, *proc.communicate(timeout=120))
    done.returncode = proc.returncode
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["iterations"] == 40
    assert summary["vexpert_balance"] >= summary["static_balance"] + 0.1
    assert summary["max_rel_error"] is not None and summary["max_rel_error"] <= 1e-4
    assert summary["tokens_per_s"] > 0 and summary["bytes_streamed"] > 0
    assert summary["slot_bytes_per_worker"] == 2 * 1 * 3 * 64 * 32 * 4  # G·vmax slots × expert (one buffer)
    progress = [line for line in done.stderr.splitlines() if line.startswith("iter ")]
    assert len(progress) >= 5 and "balance static" in progress[-1] and "tok/s" in progress[-1]
    assert any(line.startswith("metrics: http://127.0.0.1:") for line in done.stderr.splitlines())
    assert elapsed < 60
    _assert_nothing_left(marker, shm_before, proc.pid)


# ------------------------------------------------------------------------------------------------
# Metrics endpoint and config reload (k, Np)
# ------------------------------------------------------------------------------------------------


def test_reported_rate_and_bytes_are_what_happened(tmp_path: Path) -> None:
    """k = 1: windows reach the supervisor in bursts; the tokens/s gauge must not read a burst as a
    near-zero interval, and the final report must include the coordinator's last fills."""
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    config = load_runtime_config(_config(tmp_path / "runtime.yaml", checkpoint, tuning={"allocation_interval": 1}))
    setup = resolve_setup(config, checkpoint, cpu_workers=2)
    workload = drifting_workload((("decode_in1000out1000", 100),), SPEC.num_layers, SPEC.num_experts, 16)
    progress: list[Progress] = []
    runtime = NodeRuntime(setup, NodeOptions(workload=workload, iterations=16, progress=progress.append, probe=SlotAudit))
    report = runtime.run()
    tokens_per_iteration = setup.world * 16
    fastest = tokens_per_iteration / min(r.step_s for r in report.records if r.step_s)
    assert progress and max(p.tokens_per_s for p in progress) <= 1.2 * fastest
    assert report.bytes_streamed == runtime.coordinator.fills.bytes_done > 0  # the coordinator's final count
    assert f"vexpert_bytes_streamed_total {float(report.bytes_streamed)}" in report.metrics_text


def test_node_cli_summary_counts_switches_and_reports_verification(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    config = _config(tmp_path / "runtime.yaml", checkpoint, tuning={"allocation_interval": 100})
    assert cli.main(["node", "--config", str(config), "--iterations", "3", "--verify"]) == 0
    summary = [line for line in capsys.readouterr().err.splitlines() if "stopped after 3 iterations" in line]
    assert len(summary) == 1, summary
    assert "0 plan switches" in summary[0]  # k = 100: the starting plan is not a switch
    error = float(summary[0].split("max rel error ")[1])
    assert 0 <= error <= 1e-4


class _Batches:
    """Worker messages handed to the supervisor one batch at a time, as its queue drain sees them."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self.batches, self.current = [list(b) for b in batches], []  # type: ignore[var-annotated]

    def get(self, timeout: float) -> Any:
        import queue

        if not self.current and self.batches:
            self.current = self.batches.pop(0)
        if not self.current:
            raise queue.Empty
        return self.current.pop(0)

    def get_nowait(self) -> Any:
        import queue

        if not self.current:
            raise queue.Empty
        return self.current.pop(0)


def test_a_degraded_iteration_reported_with_its_window_shows_as_degraded(tmp_path: Path) -> None:
    # k = 1: rank 0 sends its iteration report and the window right after, often in one batch, and
    # the supervisor handles the window first (plans go out as early as possible)
    import numpy as np

    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    config = load_runtime_config(_config(tmp_path / "runtime.yaml", checkpoint, tuning={"allocation_interval": 1}))
    runtime = NodeRuntime(resolve_setup(config, checkpoint), NodeOptions(allocate=False))
    runtime.coordinator.attached = True
    counts, loads = np.ones((1, SPEC.num_layers, SPEC.num_experts), dtype=np.int64), np.ones((1, SPEC.num_layers, 2), dtype=np.int64)

    def report(rank: int) -> IterationDone:  # one layer ran degraded
        return IterationDone(rank=rank, iteration=0, step_s=0.01, wait_s=0.0, degraded_layers=1, plan_ids=[0])

    batches = [
        [WorkerReady(0), WorkerReady(1)],
        [report(0), report(1), CountsWindow(0, counts, loads)],
        [WorkerDone(0), WorkerDone(1)],
    ]
    runtime._serve(_Batches(batches), [])
    text = runtime.metrics.render()
    assert "vexpert_degraded 1.0" in text and "vexpert_degraded_groups_total 1.0" in text


def test_metrics_endpoint_and_config_reload(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path / "ckpt", SPEC, seed=2)
    config_path = _config(tmp_path / "runtime.yaml", tmp_path / "ckpt")
    setup = resolve_setup(load_runtime_config(config_path), tmp_path / "ckpt")
    port: list[int] = []
    scraped: list[str] = []
    state: dict[str, Any] = {}

    def progress(p: Progress) -> None:
        if not scraped and port:
            with urllib.request.urlopen(f"http://127.0.0.1:{port[0]}/metrics", timeout=5) as response:
                scraped.append(response.read().decode())
        if "rewritten_at" not in state and p.iteration >= 8:
            raw = yaml.safe_load(config_path.read_text())
            raw["tuning"] = {"allocation_interval": 3, "pooled_experts": 4}
            config_path.write_text(yaml.safe_dump(raw))
            state["rewritten_at"] = p.iteration

    workload = drifting_workload((("prefill_in4096", 1000),), 2, 8, tokens_per_worker=32)
    report = run_node(
        setup,
        NodeOptions(
            workload=workload,
            iterations=240,
            config_path=config_path,
            progress=progress,
            metrics_addr="127.0.0.1",
            on_metrics=port.append,
        ),
    )
    text = scraped[0]
    for name in ("vexpert_balance_ratio{layer=\"0\"}", "vexpert_static_balance_ratio", "vexpert_vexperts{layer=\"1\"}",
                 "vexpert_tokens_per_second", "vexpert_step_seconds_bucket", "vexpert_slot_fill_wait_seconds",
                 "vexpert_pooled_experts 8.0", "vexpert_allocation_interval 4.0", "vexpert_degraded 0.0",
                 f"vexpert_slot_bytes_per_worker {float(2 * SPEC.expert_numel * 4)}"):
        assert name in text, name
    # after the reload: windows of 3 iterations, a pool of the 4 hottest experts, plans use only those
    assert report.k == 3 and report.pooled == 4
    lengths = [length for _, length in report.windows]
    assert lengths[0] == 4 and lengths[-2] == 3
    later = [pid for pid in report.tables if report.plan_pools[pid] and len(report.plan_pools[pid][0]) == 4]
    assert later, "no plan was made with the reduced pool"
    for pid in later:
        table, pooled = report.tables[pid], report.plan_pools[pid]
        for layer in range(2):
            used = {e for e in table.slot_expert[layer].reshape(-1).tolist() if e >= 0}
            assert used <= set(pooled[layer])
    assert any((report.tables[pid].slot_expert >= 0).any() for pid in later)
    assert "vexpert_allocation_interval 3.0" in report.metrics_text
    assert "vexpert_pooled_experts 4.0" in report.metrics_text
    assert "vexpert_config_reloads_total 1.0" in report.metrics_text
    assert f"vexpert_pool_bytes {float(2 * 4 * SPEC.expert_numel * 4)}" in report.metrics_text


def _node_process(node_rank: int, checkpoint: str, port: int, results: Any) -> None:
    from vexpert_runtime.config import RuntimeConfig

    os.environ["VEXPERT_NODE_RANK"] = str(node_rank)  # as the operator's pods get it (the config says 0 or 1 too)

    config = RuntimeConfig.model_validate(
        {
            "model": {"checkpoint_path": checkpoint, "dtype": "float32"},
            "parallelism": {"expert_parallel_size": 4, "gpus_per_node": 2, "node_rank": node_rank, "master_port": port},
            "vexpert": {"balance_threshold": 0.95},
            "tuning": {"allocation_interval": 4},
            "runtime": {"device": "cpu", "metrics_port": 0},
        }
    )
    workload = drifting_workload((("decode_in1000out1000", 1000),), 2, 8, tokens_per_worker=16)
    report = run_node(resolve_setup(config, checkpoint), NodeOptions(workload=workload, iterations=24, verify=True))
    results.put((node_rank, report.iterations, report.static_balance, report.vexpert_balance, report.max_rel_error, report.allocations))


def test_two_nodes_form_one_ep_group(tmp_path: Path) -> None:
    """Two coordinators with two workers each (EP=4): counts all-reduced across nodes, each node
    fills its own workers' slots, every rank verified."""
    import multiprocessing

    checkpoint = str(write_tiny_checkpoint(tmp_path / "ckpt", SPEC, seed=7))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    nodes = [ctx.Process(target=_node_process, args=(rank, checkpoint, port, results)) for rank in range(2)]
    for proc in nodes:
        proc.start()
    try:
        got = sorted(results.get(timeout=90) for _ in nodes)
    finally:
        for proc in nodes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert [row[0] for row in got] == [0, 1]
    for _, iterations, static, measured, error, allocations in got:
        assert iterations == 24 and allocations >= 4
        assert error is not None and error <= 1e-5
        assert measured > static
    assert got[0][2] == got[1][2]  # both coordinators saw the same global counts


def test_rejected_reload_keeps_the_running_values(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    config_path = _config(tmp_path / "runtime.yaml", tmp_path / "ckpt")
    setup = resolve_setup(load_runtime_config(config_path), tmp_path / "ckpt")
    lines: list[str] = []
    runtime = NodeRuntime(setup, NodeOptions(config_path=config_path, log=lines.append))

    def rewrite(tuning: dict[str, Any]) -> None:
        raw = yaml.safe_load(config_path.read_text())
        raw["tuning"] = tuning
        config_path.write_text(yaml.safe_dump(raw))
        os.utime(config_path, ns=(time.time_ns(), time.time_ns() + 10**9 * len([*lines, ""])))
        runtime.reload.watch.last_check = 0.0
        runtime._serve_reload()

    runtime._serve_reload()  # first look records the file's mtime
    rewrite({"allocation_interval": 6, "pooled_experts": 99})
    assert runtime.balance.k == 4 and runtime.balance.pooled == 8
    assert "Np=99 does not fit" in lines[-1]
    assert "vexpert_config_reload_errors_total 1.0" in runtime.metrics.render()
    rewrite({"allocation_interval": 6, "pooled_experts": 5})
    assert runtime.balance.k == 6 and runtime.balance.pooled == 5


# ------------------------------------------------------------------------------------------------
# Bad input: one clear line, exit 2, nothing started
# ------------------------------------------------------------------------------------------------


def _drop_tensor(checkpoint: Path, name: str, replacement: torch.Tensor | None = None) -> None:
    from safetensors.torch import load_file, save_file

    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = checkpoint / index["weight_map"][name]
    tensors = load_file(str(shard))
    if replacement is None:
        del tensors[name]
    else:
        tensors[name] = replacement
    save_file(tensors, str(shard))


BAD_INPUTS = {
    "missing-tensor": ({}, r"tensor model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight is missing from model-0000\d-of-0000\d\.safetensors \(the index lists it there\)"),
    "mismatched-tensor": ({}, r"experts\.3\.down_proj\.weight in .* has shape \[32, 5\], config\.json implies \[32, 16\]"),
    "pool-too-big": ({"tuning": {"pooled_experts": 64}}, r"tuning\.pooled_experts: Np=64 does not fit the model's 8"),
    "memory-limit": ({"runtime": {"host_memory_limit_bytes": 100_000}}, r"runtime\.host_memory_limit_bytes: pool .* exceeds the limit of 100000 B"),
    "no-cuda": ({"runtime": {"device": "cuda", "cpu_workers": 0}}, r"runtime\.device: cuda was requested but no CUDA device is visible"),
    "uneven-ranks": ({"parallelism": {"expert_parallel_size": 3, "gpus_per_node": 3}, "runtime": {"cpu_workers": 3}}, r"8 experts cannot be split evenly over 3 EP ranks"),
    "index-not-a-map": ({}, r"model\.checkpoint_path: .*index\.json: weight_map must map tensor names to shard file names"),
    "config-json-list": ({}, r"model\.checkpoint_path: .*config\.json is a JSON list, not an object"),
    "runtime-yaml-not-utf8": ({}, r"--config: .*runtime\.yaml is not UTF-8 text"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    if case == "no-cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    if case == "missing-tensor":
        _drop_tensor(checkpoint, expert_tensor(2, 3, "down"))
    if case == "mismatched-tensor":
        _drop_tensor(checkpoint, expert_tensor(2, 3, "down"), torch.zeros(32, 5))
    if case == "index-not-a-map":
        index = checkpoint / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": list(json.loads(index.read_text())["weight_map"])}))
    if case == "config-json-list":
        (checkpoint / "config.json").write_text("[1]")
    sections, pattern = BAD_INPUTS[case]
    config = _config(tmp_path / "runtime.yaml", checkpoint, **sections)
    if case == "runtime-yaml-not-utf8":
        config.write_bytes(b"\xff" + config.read_bytes())
    before = set(os.listdir("/proc"))
    code = cli.main(["node", "--config", str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    import re

    assert re.search(pattern, err[0]), err[0]
    import multiprocessing

    assert multiprocessing.active_children() == []
    assert not [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _is_child(int(p))]


@pytest.mark.parametrize("field", ["parallelism.master_port", "runtime.metrics_port"])
def test_busy_port_is_one_line_and_exit_2(tmp_path: Path, field: str, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        section, key = field.split(".")
        config = _config(tmp_path / "runtime.yaml", checkpoint, **{section: {key: port}})
        code = cli.main(["node", "--config", str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    import multiprocessing

    assert multiprocessing.active_children() == []


def _is_child(pid: int) -> bool:
    try:
        return f"PPid:\t{os.getpid()}\n" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_bad_input_exit_code_from_the_real_cli(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    _drop_tensor(checkpoint, expert_tensor(1, 0, "gate"))
    config = _config(tmp_path / "runtime.yaml", checkpoint)
    marker = uuid.uuid4().hex
    done = subprocess.run(_vexpert("node", "--config", str(config)), capture_output=True, text=True, env=_env(marker), timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: model.checkpoint_path: tensor model.layers.1.mlp.experts.0.gate_proj.weight is missing")
    assert "(fix: " in lines[0]
    assert _marked_processes(marker) == []


# ------------------------------------------------------------------------------------------------
# Node rank: VEXPERT_NODE_RANK, else the StatefulSet ordinal of the pod name, else the config
# ------------------------------------------------------------------------------------------------

K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}


@pytest.mark.parametrize(
    ("env", "configured", "nodes", "rank"),
    [
        ({"VEXPERT_NODE_RANK": "1"}, 0, 2, 1),
        ({"VEXPERT_NODE_RANK": "1", "VEXPERT_POD_NAME": "d-node-0"}, 0, 2, 1),  # the env var wins
        ({"VEXPERT_NODE_RANK": "", "VEXPERT_POD_NAME": "vexpert-d-node-1"}, 0, 2, 1),  # no pod-index label (< 1.28)
        ({"VEXPERT_NODE_RANK": " ", "VEXPERT_POD_NAME": "app-12-3"}, 0, 4, 3),  # the trailing ordinal only
        ({"VEXPERT_NODE_RANK": "", "HOSTNAME": "vexpert-d-node-1", **K8S}, 0, 2, 1),
        ({"HOSTNAME": "gpu-box-7"}, 1, 2, 1),  # outside Kubernetes a hostname says nothing
        ({"HOSTNAME": "gpu-box", **K8S}, 1, 2, 1),
        ({"VEXPERT_NODE_RANK": "", "VEXPERT_POD_NAME": ""}, 1, 2, 1),
        ({}, 0, 1, 0),
    ],
)
def test_node_rank_sources(env: dict[str, str], configured: int, nodes: int, rank: int) -> None:
    assert resolve_node_rank(configured, nodes, env) == rank


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"VEXPERT_NODE_RANK": "abc"}, "VEXPERT_NODE_RANK: 'abc' is not a node index"),
        ({"VEXPERT_NODE_RANK": "-1"}, "VEXPERT_NODE_RANK: '-1' is not a node index"),
        ({"VEXPERT_NODE_RANK": "1.0"}, "VEXPERT_NODE_RANK: '1.0' is not a node index"),
        ({"VEXPERT_NODE_RANK": "\u00b2"}, "VEXPERT_NODE_RANK: '\u00b2' is not a node index"),
        ({"VEXPERT_NODE_RANK": "2"}, "VEXPERT_NODE_RANK: node rank 2 (from VEXPERT_NODE_RANK=2) ≥ number of nodes 2"),
        ({"VEXPERT_POD_NAME": "vexpert-d-node"}, "VEXPERT_POD_NAME: 'vexpert-d-node' does not end in a StatefulSet ordinal"),
        ({"VEXPERT_POD_NAME": "vexpert-d-node-5"}, "VEXPERT_POD_NAME: node rank 5 (from VEXPERT_POD_NAME=vexpert-d-node-5) ≥ number of nodes 2"),
        ({"HOSTNAME": "vexpert-d-node-2", **K8S}, "HOSTNAME: node rank 2 (from HOSTNAME=vexpert-d-node-2) ≥ number of nodes 2"),
    ],
)
def test_bad_node_rank_names_its_source(env: dict[str, str], message: str) -> None:
    with pytest.raises(VExpertInputError) as caught:
        resolve_node_rank(0, 2, env)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_empty_node_rank_falls_back_to_the_pod_ordinal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    config = _config(tmp_path / "runtime.yaml", checkpoint, parallelism={"expert_parallel_size": 4, "gpus_per_node": 2})
    monkeypatch.setenv("VEXPERT_NODE_RANK", "")
    monkeypatch.setenv("VEXPERT_POD_NAME", "vexpert-d-node-1")
    setup = resolve_setup(load_runtime_config(config), checkpoint)
    assert setup.node_rank == 1 and setup.ranks == [2, 3]


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"VEXPERT_NODE_RANK": "one"}, "error: VEXPERT_NODE_RANK: 'one' is not a node index (fix: "),
        ({"VEXPERT_NODE_RANK": "", "VEXPERT_POD_NAME": "vexpert-d-node-3"},
         "error: VEXPERT_POD_NAME: node rank 3 (from VEXPERT_POD_NAME=vexpert-d-node-3) ≥ number of nodes 1 (fix: "),
    ],
)
def test_bad_node_rank_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], line: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    config = _config(tmp_path / "runtime.yaml", checkpoint)
    for name in ("VEXPERT_NODE_RANK", "VEXPERT_POD_NAME", "HOSTNAME", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = cli.main(["node", "--config", str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(line), err


# ------------------------------------------------------------------------------------------------
# Shutdown
# ------------------------------------------------------------------------------------------------


def _start_node(tmp_path: Path, marker: str) -> subprocess.Popen[str]:
    config = _config(tmp_path / "runtime.yaml", "", model={"checkpoint_path": ""})
    return subprocess.Popen(
        _vexpert("node", "--config", str(config), "--cpu-workers", "2", "--tokens-per-worker", "8"),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=_env(marker),
        cwd=tmp_path,
        start_new_session=True,  # its own process group: a signal to the group reaches the node's processes only
    )


def _wait_for_iterations(proc: subprocess.Popen[str]) -> list[str]:
    lines: list[str] = []
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if " iter " in line:
            return lines
    raise AssertionError("the node never reported an iteration:\n" + "".join(lines))


def test_sigterm_stops_the_node_cleanly(tmp_path: Path) -> None:
    """SIGTERM to the node's whole process group — as systemd's default ``KillMode=control-group``, ``timeout`` or
    ``kill -- -PGID`` send it — stops it at an iteration boundary, exit 0, nothing left: the coordinator and the
    workers ignore it and are stopped by the node (until 2026-12-07 they died of it and the node failed)."""
    marker = uuid.uuid4().hex
    with other_programs_semaphores():  # the machine is shared: their sem.mp-* are not the run's leaks
        shm_before = _shm()
        proc = _start_node(tmp_path, marker)
        try:
            _wait_for_iterations(proc)
            pids = _marked_processes(marker)
            assert len(pids) >= 3  # coordinator + 2 workers
            assert_run_has_named_semaphores(proc.pid)
            os.killpg(proc.pid, signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        assert "stopped after" in err and "exited with code" not in err, err
        _assert_nothing_left(marker, shm_before, proc.pid, pids)
        assert noise_created_since(shm_before), "the other program created nothing beside the run"


def test_killed_coordinator_leaves_no_orphans(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    with other_programs_semaphores():
        shm_before = _shm()
        proc = _start_node(tmp_path, marker)
        try:
            _wait_for_iterations(proc)
            pids = _marked_processes(marker)
            workers = [pid for pid in pids if pid != proc.pid]
            assert len(workers) >= 2
            assert_run_has_named_semaphores(proc.pid)
            proc.kill()  # SIGKILL: no cleanup code runs in the coordinator
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        _assert_nothing_left(marker, shm_before, proc.pid, pids, within_s=10.0)
        assert noise_created_since(shm_before), "the other program created nothing beside the run"


def test_a_profiled_range_leaves_one_trace_per_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    config = load_runtime_config(_config(tmp_path / "runtime.yaml", checkpoint))
    monkeypatch.setenv("VEXPERT_PROFILE", f"2-3:{tmp_path / 'traces'}")
    report = run_node(resolve_setup(config, checkpoint), NodeOptions(iterations=5))
    assert report.iterations == 5
    traces = sorted(p.name for p in (tmp_path / "traces").glob("*.json"))
    assert traces == ["worker0-iterations2-3.json", "worker1-iterations2-3.json"]
    events = json.loads((tmp_path / "traces" / traces[0]).read_text())["traceEvents"]
    assert any("ep_moe" in str(e.get("name", "")) or e.get("cat") == "cpu_op" for e in events)


def test_a_bad_profile_request_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    config = load_runtime_config(_config(tmp_path / "runtime.yaml", checkpoint))
    monkeypatch.setenv("VEXPERT_PROFILE", "soon")
    with pytest.raises(VExpertInputError, match="VEXPERT_PROFILE"):
        run_node(resolve_setup(config, checkpoint), NodeOptions(iterations=2))


def test_a_count_window_row_holds_the_counts_and_this_ranks_computed_rows() -> None:
    """[L, E + E/N + S] statistics → [L, E + N]: the counts as they are, this rank's rows computed
    (resident experts and slots summed) in its own column, zeros for the other ranks (the window's
    all-reduce adds theirs)."""
    import numpy as np

    from vexpert_runtime.node.worker import window_row

    layers, experts, world, slots, rank = 3, 8, 4, 2, 2
    stats = np.arange(layers * (experts + experts // world + slots), dtype=np.int64).reshape(layers, -1)
    row = window_row(stats, experts, world, rank)
    assert row.shape == (layers, experts + world)
    assert np.array_equal(row[:, :experts], stats[:, :experts])
    assert np.array_equal(row[:, experts + rank], stats[:, experts:].sum(1))
    others = [experts + r for r in range(world) if r != rank]
    assert not row[:, others].any()
    stats[0, 0] = -7  # the row is a copy: the host buffer is rewritten two iterations later
    assert row[0, 0] == 0
