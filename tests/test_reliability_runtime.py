"""Runtime reliability (issue 8, runtime part), on CPU workers (gloo, shared-memory slots):

1. the coordinator's slot fill loop dies mid-run: workers keep serving on their base experts (outputs
   equal to the reference), the node reports ``degraded``, and the restarted loop resumes streaming;
2. a slot fill that fails half way through a copy: that group runs without its vExperts for that
   iteration, and no worker ever computes with a half-filled slot (bitwise slot checksums);
3. a worker crash: the node exits non-zero with a clear line, no orphan process, no leaked /dev/shm;
4. config reloads with invalid values: rejected, previous values kept, counted in metrics;
5. truncated or corrupted checkpoint shards, wrong dtypes or shapes: one clear error before any
   process or process group starts;
6. a long run (short here; ``benchmarks/long_run.py`` runs 10,000 iterations): no growth in shared
   memory, bounded RSS growth.

The table in ``benchmarks/RELIABILITY.md`` counts the cases below.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from node_faults import PacedWorkload, faulty_filler
from runtime_support import TINY_DEEPSEEK_SPEC
from scripted_plans import scripted_plans
from shm_support import assert_run_has_named_semaphores, assert_run_left_nothing
from slot_audit import SlotAudit, slot_checksums
from vexpert_runtime import cli
from vexpert_runtime.config import RuntimeConfig, load_runtime_config
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import (
    CheckpointReader,
    expert_tensor,
    router_tensor,
    write_tiny_checkpoint,
)
from vexpert_runtime.model.ep_moe import plan_from_slots
from vexpert_runtime.node import NodeOptions, NodeReport, NodeRuntime, Progress, resolve_setup
from vexpert_runtime.node.slots import row_checksum, sequence
from vexpert_runtime.policy.placement import static_placement
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload
from vexpert_runtime.workload import Workload

REPO = Path(__file__).resolve().parents[1]
SPEC = TINY_DEEPSEEK_SPEC

BASE = static_placement(2, 8, 2)  # rank 0 holds experts 0-3, rank 1 holds 4-7; G=1, vmax=2: two slots
PLAN_A = plan_from_slots(BASE, torch.tensor([[[4, 5], [0, 1]], [[6, 7], [2, 3]]]))
PLAN_B = plan_from_slots(BASE, torch.tensor([[[6, 7], [2, 3]], [[4, 5], [0, 1]]]))


def _raw_config(checkpoint: Path | str, **sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": free_port()},
        "vexpert": {"group_size": 1, "vmax": 2, "balance_threshold": 0.95},
        "tuning": {"allocation_interval": 2},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0, "slot_fill_timeout_s": 5.0},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _setup(checkpoint: Path, timeout_s: float, device: str = "cpu") -> Any:
    # two EP ranks: on a host with one GPU both workers share it (their all-to-all goes over gloo)
    sharing = 2 if device == "cuda" and torch.cuda.device_count() < 2 else 1
    raw = _raw_config(checkpoint, runtime={"device": device, "workers_per_gpu": sharing})
    setup = resolve_setup(RuntimeConfig.model_validate(raw), checkpoint)
    return dataclasses.replace(setup, slot_fill_timeout_s=timeout_s)


def _assert_slots_exact(report: NodeReport, checkpoint: Path) -> int:
    """Every slot a group computed with under a plan held exactly (bitwise) the expert the plan names."""
    reader = CheckpointReader(checkpoint, SPEC)
    checked = 0
    for record in report.records:
        for group, plan_id in enumerate(record.plan_ids):
            table = report.tables.get(plan_id)
            if plan_id == 0 or table is None:
                continue  # degraded: the group did not read its slots
            for rank, per_group in slot_checksums(record.details).items():
                for slot, expert in enumerate(table.slot_expert[group, rank].tolist()):
                    if expert >= 0:
                        assert per_group[group][slot] == row_checksum(reader.expert(group, expert, torch.float32))
                        checked += 1
    return checked


# ------------------------------------------------------------------------------------------------
# 1. The coordinator's fill loop dies: serve on base experts, report degraded, restart and stream
# ------------------------------------------------------------------------------------------------


def test_dead_fill_loop_serves_base_experts_degraded_then_resumes_streaming(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=7)
    setup = _setup(tmp_path, timeout_s=0.1)
    lines: list[str] = []
    degraded_seen: list[tuple[int, bool]] = []
    runtime_box: list[NodeRuntime] = []

    def progress(p: Progress) -> None:
        degraded_seen.append((p.iteration, "vexpert_degraded 1.0" in runtime_box[0].metrics.render()))

    runtime = NodeRuntime(
        setup,
        NodeOptions(
            # paced: the restart (a new process that loads its pool) lands well before iteration 50
            workload=PacedWorkload(tokens_per_worker=16, seed=2, pace_s=0.1),
            iterations=60,
            verify=True,
            allocate=False,
            filler=faulty_filler(kill_at=sequence(3, 0, 2)),
            fill_restart_delay_s=0.6,
            probe=SlotAudit,
            progress=progress,
            log=lines.append,
        ),
        balance=scripted_plans({0: PLAN_A, 50: PLAN_B}),  # PLAN_B needs copies: only a live loop can run it
    )
    runtime_box.append(runtime)
    report = runtime.run()
    assert report.iterations == 60
    assert report.max_rel_error is not None and report.max_rel_error <= 1e-5  # every output checked
    down = [r.iteration for r in report.records if r.plan_ids and set(r.plan_ids) == {0}]
    # iteration 3 was published before the loop died: it runs its plan, the workers fill the layers
    # the dead coordinator left from the checkpoint; from 4 on, base experts only until the restart
    assert 3 not in down and down and min(down) == 4, down
    assert any("slot fill loop died" in line for line in lines)
    assert sum("coordinator process" in line and "started" in line for line in lines) == 2, lines
    assert any(flag for _, flag in degraded_seen), "the node reported degraded while the loop was down"
    assert "vexpert_fill_loop_restarts_total 1.0" in report.metrics_text
    # after the restart: the scripted plan change streams new experts and runs undegraded
    assert report.records[-1].plan_ids == [2, 2] and report.records[-1].degraded_groups == 0
    assert degraded_seen[-1][1] is False
    assert report.bytes_streamed > 0
    assert _assert_slots_exact(report, tmp_path) > 0


# ------------------------------------------------------------------------------------------------
# 1b. The coordinator *process* is SIGKILLed: workers serve degraded, a restarted one re-attaches
# ------------------------------------------------------------------------------------------------


def test_an_iteration_left_half_filled_finishes_under_its_plan(tmp_path: Path) -> None:
    # k = 1: a new plan every iteration; the loop dies at (6, layer 1): the workers fill that layer
    # themselves, under iteration 6's plan. The run goes on until a plan is in force again after that
    # (a bound of 400 iterations): on a loaded 2-core CI host the first plans, and the restarted
    # coordinator, reached the workers after fixed runs of 10 and then 40 iterations had ended (no slot to audit)
    write_tiny_checkpoint(tmp_path, SPEC, seed=7)
    setup = _setup(tmp_path, timeout_s=5.0)
    setup = dataclasses.replace(setup, k=1)
    workload = drifting_workload((("decode_in1000out1000", 4), ("prefill_in4096", 4)), 2, 8, tokens_per_worker=16)
    box: list[NodeRuntime] = []

    def progress(p: Progress) -> None:
        if p.iteration >= 12 and p.plan_id > 0:
            box[0].request_stop()

    box.append(NodeRuntime(setup, NodeOptions(workload=workload, iterations=400, verify=True, probe=SlotAudit,
                                              filler=faulty_filler(kill_at=sequence(6, 1, 2)), fill_restart_delay_s=0.3,
                                              progress=progress)))
    report = box[0].run()
    assert report.iterations < 400, "no plan in force again after the fill loop died"
    assert report.max_rel_error is not None and report.max_rel_error <= 1e-5
    mixed = [(r.iteration, r.plan_ids) for r in report.records if len(set(r.plan_ids)) > 1 and 0 not in r.plan_ids]
    assert mixed == [], "all groups of one iteration use one plan"
    assert _assert_slots_exact(report, tmp_path) > 0


def test_a_stop_while_the_fill_loop_is_down_mid_iteration_is_prompt(tmp_path: Path) -> None:
    import threading

    write_tiny_checkpoint(tmp_path, SPEC, seed=7)
    setup = _setup(tmp_path, timeout_s=5.0)
    box: list[NodeRuntime] = []
    marks: dict[str, float] = {}

    def watch(line: str) -> None:
        if "slot fill loop died" in line and "stop" not in marks:
            def stop() -> None:  # the workers rescued (4, layer 1) and run degraded; restart at 0.5 s
                marks["stop"] = time.monotonic()
                box[0].request_stop()
            threading.Timer(0.25, stop).start()

    runtime = NodeRuntime(setup, NodeOptions(workload=Workload(tokens_per_worker=16, seed=1), iterations=1000,
                                             probe=SlotAudit, allocate=False,
                                             filler=faulty_filler(kill_at=sequence(4, 1, 2)), fill_restart_delay_s=0.5, log=watch),
                         balance=scripted_plans({0: PLAN_A}))
    box.append(runtime)
    report = runtime.run()
    took = time.monotonic() - marks["stop"]
    assert took < 4.0, f"stopped {took:.2f} s after the request (slot wait is 5 s)"
    assert report.records[4].plan_ids == [1, 1]  # the interrupted iteration finished under its plan (rescued)



def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def _live_children() -> set[int]:
    """This process's children, without zombies and the multiprocessing resource tracker."""
    found = set()
    for pid in _children():
        try:
            if b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                continue
        except OSError:
            continue
        found.add(pid)
    return found




@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
def test_killed_coordinator_process_workers_serve_degraded_then_a_restarted_one_resumes_streaming(
        tmp_path: Path, device: str) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=9)
    # the node marks the coordinator down: workers do not wait it out, so a long timeout costs nothing
    # here; it only keeps a CPU-starved host (a restarted coordinator's first full copy) from
    # degrading groups after the re-attach that this test requires to run undegraded
    setup = _setup(tmp_path, timeout_s=15.0, device=device)
    children_before, shm_before = _live_children(), _shm()
    phases = (("decode_in1000out1000", 6), ("prefill_in4096", 6))  # drifting skew: the plans keep changing
    workload = drifting_workload(phases, SPEC.num_layers, SPEC.num_experts, tokens_per_worker=16, seed=4)
    lines: list[str] = []
    box: list[NodeRuntime] = []
    # (iteration, degraded, coordinator pid, bytes streamed, when)
    samples: list[tuple[int, bool, int | None, float, float]] = []
    events: dict[str, Any] = {}

    def progress(p: Progress) -> None:
        runtime = box[0]
        text, pid = runtime.metrics.render(), runtime.coordinator_pid
        up = _metric(text, "vexpert_coordinator_up") == 1.0
        samples.append((p.iteration, _metric(text, "vexpert_degraded") == 1.0, pid,
                        _metric(text, "vexpert_bytes_streamed_total"), time.monotonic()))
        if "killed" not in events and p.iteration >= 8 and up and pid is not None:
            events["pids"] = _live_children()  # the node's processes: whose /dev/shm objects count
            events["killed"] = (p.iteration, pid, time.monotonic(), samples[-1][3])
            os.kill(pid, signal.SIGKILL)
        elif "killed" in events and "attached" not in events and up and pid not in (None, events["killed"][1]):
            events["attached"] = (p.iteration, pid, time.monotonic())
        elif "attached" in events and "resumed" not in events and not samples[-1][1]:
            # the restarted coordinator's first full copy done: the node runs undegraded again (how many
            # iterations that takes depends on the host's CPUs: a 2-core CI host running other tests is slow)
            events["resumed"] = (p.iteration, time.monotonic())
            events["pids"] |= _live_children()
        elif "resumed" in events and p.iteration >= events["resumed"][0] + 16:
            runtime.request_stop()

    runtime = NodeRuntime(
        setup,
        NodeOptions(
            workload=workload,
            iterations=5000,  # a bound; the test stops it
            verify=True,
            fill_restart_delay_s=0.5,
            probe=SlotAudit,
            progress=progress,
            log=lines.append,
        ),
    )
    box.append(runtime)
    started = time.monotonic()
    report = runtime.run()
    elapsed = time.monotonic() - started
    killed_at, killed_pid, killed_t, streamed_at_kill = events["killed"]
    attached_at, new_pid, attached_t = events["attached"]
    # the workers kept going and every output (degraded ones included) equals the reference
    assert report.iterations >= events["resumed"][0] + 16
    assert report.max_rel_error is not None and report.max_rel_error <= 1e-5
    assert all(r.reports == 2 for r in report.records)
    # while it was down: base experts only, and the node said so
    down = [r for r in report.records if killed_at < r.iteration < attached_at]
    degraded_iterations = [r.iteration for r in down if set(r.plan_ids) == {0}]
    assert degraded_iterations, "iterations ran while no coordinator was attached"
    # The node says so once the supervisor has seen the death: at its next poll, after the batch of reports
    # it is handling. A loaded host's supervisor lags the workers, so the windows it handles right after the
    # kill (same batch) may be of iterations run before it; half a second later every window is flagged.
    late = [(i, flag) for i, flag, _, _, t in samples if t >= killed_t + 0.5 and i < attached_at]
    assert late and all(flag for _, flag in late), ([x for x in late if not x[1]], killed_at, attached_at)
    flagged = [i for i, flag, _, _, _ in samples if killed_at < i < attached_at and flag]
    assert all(flag for i, flag, _, _, _ in samples if flagged[0] <= i < attached_at)
    assert any(line.startswith("vexpert-coordinator exited with code -9 (killed by SIGKILL)") for line in lines), lines
    assert any(f"coordinator {new_pid} attached" in line for line in lines), lines
    assert "vexpert_coordinator_restarts_total 1.0" in report.metrics_text
    # a restarted coordinator resumed streaming: later plan changes copied experts and ran undegraded
    assert new_pid != killed_pid
    resumed_at, resumed_t = events["resumed"]
    assert resumed_t - attached_t < 60, "the restarted coordinator took over a minute to fill the slots"
    after = [r for r in report.records if r.iteration > resumed_at]
    assert after and all(r.degraded_groups == 0 and 0 not in r.plan_ids for r in after)
    assert len({pid for r in after for pid in r.plan_ids}) >= 2, "plans changed after the restart"
    assert report.bytes_streamed > streamed_at_kill
    assert samples[-1][1] is False
    assert _assert_slots_exact(report, tmp_path) > 0
    # the killed coordinator is gone (reaped), nothing of the node is left
    with pytest.raises(ProcessLookupError):
        os.kill(killed_pid, 0)
    assert _live_children() == children_before
    # shared tensors (slots, protocol state) of this process and the node's; the node's named
    # semaphores live as long as the Python objects of this (test) process that hold them — at
    # process exit, see the CLI tests (3a, 1c). Other processes' objects (a parallel test) do not count.
    assert_run_left_nothing(os.getpid(), events["pids"] | {killed_pid, new_pid}, shm_before, within_s=5.0)
    print(
        f"killed at iteration {killed_at}, re-attached at {attached_at} ({attached_t - killed_t:.1f} s later), "
        f"{len(degraded_iterations)} iterations served degraded, {report.iterations} in {elapsed:.1f} s"
    )


# ------------------------------------------------------------------------------------------------
# 2. A slot fill fails half way through a copy: that group runs degraded, no half-filled slot read
# ------------------------------------------------------------------------------------------------


def test_a_fill_failing_half_way_is_rescued_and_never_exposes_a_half_copied_slot(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, SPEC, seed=8)
    setup = _setup(tmp_path, timeout_s=0.3)
    failing = sequence(2, 1, 2)  # iteration 2, layer 1: the first fill under PLAN_B there
    lines: list[str] = []
    box: list[NodeRuntime] = []
    served_a_again: list[int] = []
    degraded_so_far = [0]

    def progress(p: Progress) -> None:
        # stop a few windows after plan 3 (A again) ran undegraded (no degraded group added in the
        # window): how soon the restarted coordinator fills it depends on the host (a loaded 2-core
        # CI host is slow)
        if p.iteration > 32 and p.plan_id == 3 and p.degraded_groups == degraded_so_far[0]:
            served_a_again.append(p.iteration)
            if len(served_a_again) >= 3:
                box[0].request_stop()
        degraded_so_far[0] = p.degraded_groups

    runtime = NodeRuntime(
        setup,
        NodeOptions(
            workload=PacedWorkload(tokens_per_worker=16, seed=3, pace_s=0.1),
            iterations=400,  # a bound; the test stops it
            verify=True,
            allocate=False,
            filler=faulty_filler(fail_at_copy={failing: 0}),
            fill_restart_delay_s=0.2,
            probe=SlotAudit,
            progress=progress,
            log=lines.append,
        ),
        # back to A's experts at 30 (a new coordinator by then): the slot half overwritten at 2
        # held an A expert, and a fill that trusted its old tag would skip the copy
        balance=scripted_plans({0: PLAN_A, 2: PLAN_B, 30: PLAN_A}),
    )
    box.append(runtime)
    report = runtime.run()
    assert served_a_again, f"plan 3 never ran undegraded in {report.iterations} iterations"
    # the coordinator exits; the workers fill the half-written layer from the checkpoint themselves
    assert report.records[2].plan_ids == [2, 2] and report.records[2].degraded_groups == 0
    assert _metric(report.metrics_text, "vexpert_rescued_layers_total") >= 1
    assert report.records[-1].plan_ids == [3, 3] and report.records[-1].degraded_groups == 0
    assert report.max_rel_error is not None and report.max_rel_error <= 1e-5
    assert "vexpert_slot_fill_errors_total 1.0" in report.metrics_text
    assert any("slot fill loop died (SlotFillError" in line for line in lines), lines
    assert _assert_slots_exact(report, tmp_path) > 0


# ------------------------------------------------------------------------------------------------
# 3. A worker crash: exit non-zero, one clear line, nothing left behind
# ------------------------------------------------------------------------------------------------


def _marked_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes() and "State:\tZ" not in (entry / "status").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _workers(marker: str, coordinator: int) -> list[int]:
    pids = []
    for pid in _marked_processes(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid != coordinator and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


def _coordinator_pid(lines: list[str]) -> int:
    """The pid of the last coordinator process the node's log names."""
    pids = [int(m.group(1)) for line in lines if (m := re.search(r"coordinator process (\d+) started", line))]
    assert pids, lines
    return pids[-1]


def test_worker_crash_exits_non_zero_with_a_clear_line_and_leaves_nothing(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    shm_before = _shm()
    config = tmp_path / "runtime.yaml"
    config.write_text(yaml.safe_dump(_raw_config("", vexpert={"group_size": 2, "vmax": 1})))
    proc = subprocess.Popen(
        [sys.executable, "-m", "vexpert_runtime", "node", "--config", str(config), "--cpu-workers", "2", "--tokens-per-worker", "8"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "VEXPERT_TEST_MARKER": marker, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        seen: list[str] = []
        while time.monotonic() < deadline and " iter " not in (seen[-1] if seen else ""):
            seen.append(proc.stderr.readline())
        coordinator = _coordinator_pid(seen)
        workers = [pid for pid in _workers(marker, proc.pid) if pid != coordinator]
        assert len(workers) == 2
        assert_run_has_named_semaphores(proc.pid)
        os.kill(workers[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    failure = [line for line in err.splitlines() if line.startswith("error: node failed:")]
    assert len(failure) == 1 and "exited with code -9" in failure[0], err
    deadline = time.monotonic() + 10
    while _marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked_processes(marker) == [], "processes of the node are still alive"
    assert_run_left_nothing(proc.pid, [coordinator, *workers], shm_before)  # other programs' objects not counted


# ------------------------------------------------------------------------------------------------
# 4. Config reload with invalid values
# ------------------------------------------------------------------------------------------------

BAD_RELOADS: dict[str, Any] = {
    "k-zero": {"allocation_interval": 0},
    "k-negative": {"allocation_interval": -3},
    "k-huge": {"allocation_interval": 10**9},
    "k-not-a-number": {"allocation_interval": "often"},
    "np-too-big": {"pooled_experts": 99},
    "np-zero": {"pooled_experts": 0},
    "unknown-key": {"allocation_intervall": 6},
    "tuning-not-a-mapping": "fast",
    "not-yaml": b"tuning: {allocation_interval: [6\n",
    "not-utf8": b"\xff\xfe\x00garbage\x81",
    "top-level-list": b"- 1\n- 2\n",
    "empty-file": b"",
}


@pytest.mark.parametrize("case", list(BAD_RELOADS))
def test_invalid_reload_is_rejected_counted_and_the_old_values_kept(tmp_path: Path, case: str) -> None:
    write_tiny_checkpoint(tmp_path / "ckpt", SPEC)
    path = tmp_path / "runtime.yaml"
    raw = _raw_config(tmp_path / "ckpt", tuning={"allocation_interval": 4})
    path.write_text(yaml.safe_dump(raw))
    setup = resolve_setup(load_runtime_config(path), tmp_path / "ckpt")
    lines: list[str] = []
    runtime = NodeRuntime(setup, NodeOptions(config_path=path, log=lines.append))
    runtime._start_metrics()  # gauges as a running node has them (no endpoint: metrics_port 0)
    runtime._serve_reload()  # the first look records the file's mtime
    bad = BAD_RELOADS[case]
    if isinstance(bad, bytes):
        path.write_bytes(bad)
    else:
        path.write_text(yaml.safe_dump({**raw, "tuning": bad}))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    runtime.reload.watch.last_check = 0.0
    runtime._serve_reload()
    assert (runtime.balance.k, runtime.balance.pooled) == (4, 8)
    metrics = runtime.metrics.render()
    assert "vexpert_config_reload_errors_total 1.0" in metrics and "vexpert_config_reloads_total 0.0" in metrics
    assert "vexpert_allocation_interval 4.0" in metrics and "vexpert_pooled_experts 8.0" in metrics
    reloads = [line for line in lines if line.startswith("config reload")]  # (the node also logs its dispatch mode)
    assert len(reloads) == 1 and reloads[0].startswith("config reload rejected, keeping k=4 Np=8: ")
    # and a good file afterwards still applies
    path.write_text(yaml.safe_dump({**raw, "tuning": {"allocation_interval": 6, "pooled_experts": 5}}))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    runtime.reload.watch.last_check = 0.0
    runtime._serve_reload()
    assert (runtime.balance.k, runtime.balance.pooled) == (6, 5)
    runtime.metrics.close()


# ------------------------------------------------------------------------------------------------
# 5. Bad checkpoints: one clear error before any process (group) starts
# ------------------------------------------------------------------------------------------------


def _shard_of(checkpoint: Path, name: str) -> Path:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    return checkpoint / index["weight_map"][name]


def _replace(checkpoint: Path, name: str, value: torch.Tensor) -> None:
    shard = _shard_of(checkpoint, name)
    tensors = load_file(str(shard))
    tensors[name] = value
    save_file(tensors, str(shard))


def _truncate(fraction: float) -> Any:
    def damage(checkpoint: Path) -> None:
        shard = _shard_of(checkpoint, expert_tensor(2, 3, "up"))
        data = shard.read_bytes()
        shard.write_bytes(data[: int(len(data) * fraction)])

    return damage


def _overwrite_header(checkpoint: Path) -> None:
    shard = _shard_of(checkpoint, expert_tensor(1, 0, "gate"))
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00garbage{not json at all}\xff\xfe\x00\x01\x02"
    shard.write_bytes(bytes(data))


def _huge_header_length(checkpoint: Path) -> None:
    shard = _shard_of(checkpoint, expert_tensor(1, 0, "gate"))
    data = bytearray(shard.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    shard.write_bytes(bytes(data))


def _empty_shard(checkpoint: Path) -> None:
    _shard_of(checkpoint, expert_tensor(1, 0, "gate")).write_bytes(b"")


def _deleted_shard(checkpoint: Path) -> None:
    _shard_of(checkpoint, expert_tensor(1, 0, "gate")).unlink()


BAD_CHECKPOINTS: dict[str, tuple[Any, str]] = {
    "truncated-half": (_truncate(0.5), r"is not a safetensors file"),
    "truncated-header": (_truncate(0.001), r"is not a safetensors file"),
    "header-garbage": (_overwrite_header, r"is not a safetensors file"),
    "header-length-huge": (_huge_header_length, r"is not a safetensors file"),
    "empty-shard": (_empty_shard, r"is not a safetensors file"),
    "deleted-shard": (_deleted_shard, r"names model-0000\d-of-0000\d\.safetensors, which is missing"),
    "expert-int32": (lambda c: _replace(c, expert_tensor(2, 3, "up"), torch.zeros(16, 32, dtype=torch.int32)), r"up_proj\.weight .*dtype|I32"),
    "router-int8": (lambda c: _replace(c, router_tensor(1), torch.zeros(8, 32, dtype=torch.int8)), r"gate\.weight .*dtype|I8"),
    "expert-wrong-shape": (lambda c: _replace(c, expert_tensor(1, 5, "down"), torch.zeros(32, 17)), r"has shape \[32, 17\], config\.json implies \[32, 16\]"),
    "router-transposed": (lambda c: _replace(c, router_tensor(2), torch.zeros(32, 8)), r"has shape \[32, 8\], config\.json implies \[8, 32\]"),
    "expert-1d": (lambda c: _replace(c, expert_tensor(1, 1, "gate"), torch.zeros(512)), r"has shape \[512\]"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_is_refused_before_anything_starts(tmp_path: Path, case: str) -> None:
    import torch.distributed as dist

    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC, shards=2)
    damage, message = BAD_CHECKPOINTS[case]
    damage(checkpoint)
    config = RuntimeConfig.model_validate(_raw_config(checkpoint))
    children_before = _children()
    with pytest.raises(VExpertInputError, match=message) as raised:
        resolve_setup(config, checkpoint)
    assert raised.value.field == "model.checkpoint_path"
    assert "\n" not in str(raised.value)
    assert not dist.is_initialized() and _children() == children_before


def _children() -> set[int]:
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == me:
                found.add(int(entry.name))
    return found


def test_bad_checkpoint_through_the_cli_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", SPEC, shards=2)
    _truncate(0.5)(checkpoint)
    config = tmp_path / "runtime.yaml"
    config.write_text(yaml.safe_dump(_raw_config(checkpoint)))
    code = cli.main(["node", "--config", str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "model.checkpoint_path" in err[0] and "is not a safetensors file" in err[0], err


# ------------------------------------------------------------------------------------------------
# 6. Long run (short version of benchmarks/long_run.py)
# ------------------------------------------------------------------------------------------------


def _long_run_module() -> Any:
    spec = importlib.util.spec_from_file_location("long_run", REPO / "benchmarks" / "long_run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["long_run"] = module
    spec.loader.exec_module(module)
    return module


def test_short_long_run_keeps_shared_memory_flat_and_rss_bounded() -> None:
    long_run = _long_run_module()
    result = long_run.run_long(iterations=150, k=5, rss_slack_mb=16.0, keep_history=50)
    assert result.iterations == 150
    assert result.records_kept <= 55  # the node's history is bounded (a node runs until SIGTERM)
    # a new plan every k = 5 iterations (30) where the host keeps pace; a loaded 2-core host (the suite's other
    # worker beside it) skips plans whose fills come late — 16 seen — and what is checked here is memory across switches
    assert result.plan_switches >= 10
    assert len(result.samples) >= 25
    assert result.problems == []
    steady = result.samples[len(result.samples) // 5 :]
    assert steady[0].shm_entries > 0, "the run's /dev/shm entries are not seen: the count went blind"
    assert max(s.shm_entries for s in steady) <= steady[0].shm_entries
    assert max(s.shm_fds for s in steady) <= steady[0].shm_fds
