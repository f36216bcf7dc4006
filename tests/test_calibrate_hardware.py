"""`vexpert calibrate hardware`: the derivations on synthetic timings (η, BW_H2D, compute-bound
knee, termination message), the node facts readers on fake /proc and /sys trees, the CPU twin end
to end through the CLI, and (with CUDA) the real protocol on the node's GPUs."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vexpert_runtime.calibration import hardware as hw
from vexpert_runtime.calibration import nodeinfo as ni
from vexpert_runtime.cli import main
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.profile import (
    NodeTypeKey,
    PerformanceProfile,
    Provenance,
    load_profile,
    parse_profile,
)

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")

# ------------------------------------------------------------------------------ derivations


def test_eta_recovers_paper_value_from_synthetic_timings() -> None:
    t_a2a, h2d, eta = 3.89e-3, 3.42e-3, 0.19
    assert hw.derive_eta(t_a2a, t_a2a + eta * h2d, h2d) == pytest.approx(eta)


def test_eta_per_gpu_and_node_aggregate() -> None:
    etas = [0.05, 0.10, 0.20, 0.15]
    h2d = [2.4e-3, 3.1e-3, 3.4e-3, 2.9e-3]
    alone = [4.0e-3, 4.1e-3, 4.2e-3, 4.05e-3]
    cont = [a + e * h for a, e, h in zip(alone, etas, h2d, strict=True)]
    res = hw.derive_eta_per_gpu(alone, cont, h2d)
    assert res.per_gpu == pytest.approx(etas)
    assert res.spread == pytest.approx(0.15)
    assert res.eta == pytest.approx((max(cont) - max(alone)) / max(h2d))
    with pytest.raises(ValueError):
        hw.derive_eta_per_gpu([1.0], [1.0, 2.0], [1.0])


def test_bandwidth_is_set_by_the_slowest_gpu() -> None:
    # paper Fig. 9: eight H2D times, the slowest (3.42 ms) gives ≈ 25.8 GB/s for the 88.2 MB payload
    times_ms = [3.24, 2.42, 3.42, 3.26, 3.25, 3.13, 2.31, 2.43]
    payload = int(25.8e9 * 3.42e-3)
    res = hw.derive_bandwidth(payload, [t / 1e3 for t in times_ms])
    assert res.bandwidth_gb_per_s == pytest.approx(25.8, rel=1e-3)
    assert min(res.per_gpu_gb_per_s) == pytest.approx(res.bandwidth_gb_per_s)
    assert res.spread_pct == pytest.approx(100 * (1 - 2.31 / 3.42), rel=1e-6)
    with pytest.raises(ValueError):
        hw.derive_bandwidth(payload, [0.0])


def test_threshold_recovers_knee_of_synthetic_curve() -> None:
    t0, slope = 20e-6, 0.125e-6  # knee at 160 tokens per expert (the paper's figure)
    xs = [2**i for i in range(11)]
    fit = hw.compute_bound_threshold(xs, [max(t0, slope * x) for x in xs])
    assert fit.threshold == pytest.approx(160.0)
    assert fit.floor_s == pytest.approx(t0)
    assert fit.slope_s_per_token == pytest.approx(slope)
    assert not fit.clipped
    noisy = [max(t0, slope * x) * (1 + 0.02 * (-1) ** i) for i, x in enumerate(xs)]
    assert hw.compute_bound_threshold(xs, noisy).threshold == pytest.approx(160.0, rel=0.05)


def test_threshold_is_clipped_to_the_measured_range() -> None:
    xs = [1, 2, 4, 8, 16, 32]
    flat = hw.compute_bound_threshold(xs, [1e-3] * len(xs))  # never compute-bound in range
    assert flat.clipped and flat.threshold == 32
    linear = hw.compute_bound_threshold(xs, [1e-6 * x for x in xs])  # compute-bound from the start
    assert not linear.clipped and linear.threshold == pytest.approx(2.0)  # t0 = median of 1, 2, 4 µs
    steep = hw.compute_bound_threshold(xs, [1e-6, 1e-6, 1e-6, 100e-6, 200e-6, 400e-6])  # knee below 1 TPE
    assert steep.clipped and steep.threshold == 1


def test_rounds_cover_the_copy() -> None:
    assert hw.a2a_rounds_to_cover(3.2e-3, 0.16e-3) == 30
    assert hw.a2a_rounds_to_cover(1e-4, 1e-3) == 1
    assert hw.a2a_rounds_to_cover(1.0, 0.0) == 1
    assert hw.a2a_rounds_to_cover(1.0, 1e-9) == hw.MAX_ROUNDS


def test_parameters_are_clamped_into_the_profile_ranges() -> None:
    p = hw.hardware_parameters(54.0, -0.01, 150.0)
    assert p.contention_eta == 0.0 and p.h2d_bandwidth_gb_per_s == 54.0
    assert hw.hardware_parameters(54.0, 42.0, 150.0).contention_eta == 10.0
    assert hw.hardware_parameters(54.0, math.nan, 150.0).contention_eta == 0.0


def _bulky_profile(gpus: int = 8, points: int = 400) -> PerformanceProfile:
    measurements: dict[str, Any] = {
        "device": "cuda", "world": gpus, "eta_method": "all-to-all: 8 ranks over NCCL, Eq. 7", "eta": 0.0312,
        "eta_per_gpu": [0.031234567] * gpus, "h2d_gbps_contended": [53.71234] * gpus,
        "h2d_gbps_alone": [54.9876] * gpus, "compute_tpe": list(range(points)),
        "compute_ms": [0.123456789] * points, "elapsed_s": 31.4,
        "gpus": [{"bus": f"00000000:{i:02x}:00.0", "numa": i // 4, "link": "32.0 GT/s PCIe x16"} for i in range(gpus)],
        "details": {"ranks": [[1.0] * 1000] * gpus},
    }
    prov = Provenance(source="hardware-calibration", tool_version="0.1.0",
                      node_type=NodeTypeKey(gpu_product="NVIDIA-H200", gpu_count=gpus, gpu_memory_mib=143771,
                                            driver_version="570.124.06", instance_type="p5en.48xlarge"),
                      measurements=measurements)
    return PerformanceProfile(hardware=hw.hardware_parameters(53.7, 0.0312, 150.0), provenance=prov)


def test_termination_message_fits_and_parses_back() -> None:
    profile = _bulky_profile()
    assert len(profile.model_dump_json().encode()) > hw.TERMINATION_LIMIT_BYTES
    text = hw.fit_to_termination_message(profile)
    assert len(text.encode()) <= hw.TERMINATION_LIMIT_BYTES
    back = parse_profile(json.loads(text))
    assert back.hardware == profile.hardware
    assert back.provenance.node_type == profile.provenance.node_type
    kept = back.provenance.measurements
    assert kept["trimmed"] is True and "details" not in kept and "compute_ms" not in kept
    for key in hw.ESSENTIAL_KEYS:
        assert kept[key] == profile.provenance.measurements[key]
    tight = hw.fit_to_termination_message(profile, limit=900)
    assert len(tight.encode()) <= 900
    parse_profile(json.loads(tight))


def test_small_termination_message_is_the_profile_unchanged() -> None:
    profile = _bulky_profile(gpus=2, points=4).model_copy()
    profile.provenance.measurements.pop("details")
    text = hw.fit_to_termination_message(profile)
    assert json.loads(text) == json.loads(profile.model_dump_json())


def test_default_termination_log_only_inside_kubernetes(tmp_path: Path) -> None:
    target = tmp_path / "termination-log"
    assert hw.default_termination_log({}, str(target)) is None
    assert hw.default_termination_log({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(target)) == str(target)
    target.write_text("")
    assert hw.default_termination_log({}, str(target)) == str(target)
    assert hw.default_termination_log({"KUBERNETES_SERVICE_HOST": "x"}, str(tmp_path / "no" / "log")) is None


def _args(**kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = dict(cpu=False, gpus=None, iters=None, expert_bytes=None, hidden=None, intermediate=None,
                                tokens=None, top_k=None, max_tpe=1024, timeout=300.0)
    base.update(kw)
    return argparse.Namespace(**base)


def test_settings_defaults_and_validation() -> None:
    s = hw.settings_from_args(_args(), cuda_available=True, device_count=8)
    assert (s.device, s.world, s.hidden, s.intermediate, s.tokens, s.top_k) == ("cuda", 8, 7168, 2048, 256, 8)
    assert s.payload_bytes == 2 * 3 * 7168 * 2048 * 2  # two DeepSeek-V3 bf16 experts
    assert s.a2a_bytes == 256 * 8 * 7168 * 2
    assert s.tpe_points == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    c = hw.settings_from_args(_args(cpu=True), cuda_available=False, device_count=0)
    assert (c.device, c.world, c.payload_bytes) == ("cpu", 2, 2 * 3 * 1024 * 256 * 4)
    assert hw.HardwareSettings("cpu", 3, 1, 1, 8, 8, 5, 1, max_tpe=100).a2a_rows == 6
    assert hw.HardwareSettings("cpu", 3, 1, 1, 8, 8, 5, 1, max_tpe=100).tpe_points[-1] == 100
    for bad, field in ((_args(gpus=9), "--gpus"), (_args(iters=0), "--iters"), (_args(hidden=0), "--hidden"),
                       (_args(expert_bytes=0), "--expert-bytes"), (_args(max_tpe=1), "--max-tpe")):
        with pytest.raises(VExpertInputError) as err:
            hw.settings_from_args(bad, cuda_available=True, device_count=8)
        assert err.value.field == field
    with pytest.raises(VExpertInputError, match="--cpu"):
        hw.settings_from_args(_args(), cuda_available=False, device_count=0)


# ---------------------------------------------------------------------------------- nodeinfo


def test_bus_id_normalisation() -> None:
    assert ni.normalize_bus_id("00000000:19:00.0") == "00000000:19:00.0"
    assert ni.normalize_bus_id("0000:9A:00.0") == "00000000:9a:00.0"
    assert ni.normalize_bus_id("19:00.0") == "00000000:19:00.0"
    assert ni.normalize_bus_id("garbage") is None


def _fake_pci(root: Path, name: str, numa: str, speed: str, width: str) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "numa_node").write_text(numa + "\n")
    (d / "current_link_speed").write_text(speed + "\n")
    (d / "current_link_width").write_text(width + "\n")


def test_pci_link_reads_sysfs_in_either_domain_form(tmp_path: Path) -> None:
    _fake_pci(tmp_path, "0000:19:00.0", "1", "32.0 GT/s PCIe", "16")
    _fake_pci(tmp_path, "00010000:3b:00.0", "-1", "16.0 GT/s PCIe", "8")
    a = ni.pci_link("00000000:19:00.0", tmp_path)
    assert (a["numa_node"], a["link_speed"], a["link_width"], a["max_link_speed"]) == (1, "32.0 GT/s PCIe", 16, None)
    b = ni.pci_link("00010000:3B:00.0", tmp_path)
    assert (b["numa_node"], b["link_width"]) == (None, 8)  # -1: no NUMA affinity
    assert ni.pci_link("00000000:aa:00.0", tmp_path)["link_speed"] is None
    assert ni.pci_link(None, tmp_path)["numa_node"] is None


def test_host_facts_and_their_absence(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       24684084 kB\nMemFree: 1 kB\n")
    assert ni.host_memory_bytes(tmp_path / "meminfo") == 24684084 * 1024
    assert ni.host_memory_bytes(tmp_path / "missing") is None
    nodes = tmp_path / "node"
    for name in ("node0", "node1", "possible", "nodeX"):
        (nodes / name).mkdir(parents=True)
    assert ni.numa_nodes(nodes) == [0, 1]
    assert ni.numa_nodes(tmp_path / "missing") is None
    assert ni.instance_type({"NODE_INSTANCE_TYPE": "p5.48xlarge"}) == "p5.48xlarge"
    assert ni.instance_type({"VEXPERT_INSTANCE_TYPE": "a", "NODE_INSTANCE_TYPE": "b"}) == "a"
    assert ni.instance_type({}) is None


def test_nvidia_smi_rows_merge_by_bus_id(tmp_path: Path) -> None:
    rows = ni.parse_nvidia_smi_csv(
        "0, NVIDIA H200, 143771, 570.124.06, 00000000:19:00.0\n1, NVIDIA H200, 143771, 570.124.06, 00000000:3B:00.0\n"
        "bad line\n")
    assert [r["bus_id"] for r in rows] == ["00000000:19:00.0", "00000000:3b:00.0"]
    _fake_pci(tmp_path, "0000:3b:00.0", "0", "32.0 GT/s PCIe", "16")
    # torch's device 0 is the GPU NVML lists second (CUDA_DEVICE_ORDER / CUDA_VISIBLE_DEVICES)
    torch_facts = [{"index": 0, "name": "NVIDIA H200", "memory_mib": 140000, "bus_id": "00000000:3b:00.0"}]
    gpus = ni.merge_gpu_facts(torch_facts, rows, tmp_path)
    assert len(gpus) == 1 and gpus[0].memory_mib == 143771 and gpus[0].link_width == 16 and gpus[0].numa_node == 0
    key = ni.node_type_key(ni.NodeInfo(driver_version="570.124.06", instance_type="p5en", gpus=gpus))
    assert key == NodeTypeKey(gpu_product="NVIDIA-H200", gpu_count=1, gpu_memory_mib=143771,
                              driver_version="570.124.06", instance_type="p5en")


def test_collect_node_info_never_raises() -> None:
    info = ni.collect_node_info([{"index": 0, "name": None, "memory_mib": None, "bus_id": None}])
    json.dumps(info.as_dict())
    assert info.gpus[0].index == 0


# ------------------------------------------------------------------------------ end to end


def test_cpu_twin_end_to_end_via_the_cli(tmp_path: Path) -> None:
    term, full = tmp_path / "termination-log", tmp_path / "full.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NODE_INSTANCE_TYPE": "ci-runner"}
    proc = subprocess.run(
        [sys.executable, "-m", "vexpert_runtime", "calibrate", "hardware", "--cpu", "--json", "--iters", "8",
         "--termination-log", str(term), "--output", str(full)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    profile = PerformanceProfile.model_validate_json(proc.stdout)
    assert profile.provenance.source == "hardware-calibration"
    assert profile.provenance.node_type is not None and profile.provenance.node_type.instance_type == "ci-runner"
    assert profile.hardware.h2d_bandwidth_gb_per_s > 0
    assert math.isfinite(profile.hardware.contention_eta) and math.isfinite(profile.provenance.measurements["eta"])
    m = profile.provenance.measurements
    assert m["world"] == 2 and len(m["eta_per_gpu"]) == 2 and len(m["h2d_gbps_contended"]) == 2
    assert m["eta_method"].startswith("all-to-all") and m["elapsed_s"] < 30
    assert 1 <= profile.hardware.compute_bound_tokens_per_expert <= 1024
    assert m["compute_tpe"][-1] == 1024 and all(t > 0 for t in m["compute_ms"])
    message = term.read_text()
    assert len(message.encode()) <= hw.TERMINATION_LIMIT_BYTES
    assert parse_profile(json.loads(message)).hardware == profile.hardware
    loaded = load_profile(full)  # the full result is itself a loadable profile
    assert loaded.hardware == profile.hardware
    assert len(loaded.provenance.measurements["details"]["ranks"]) == 2


def test_cpu_twin_single_rank_reports_a_proxy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["calibrate", "hardware", "--cpu", "--gpus", "1", "--iters", "3", "--max-tpe", "64",
                 "--termination-log", str(tmp_path / "t"), "--output", str(tmp_path / "o.json")])
    out = capsys.readouterr().out
    assert code == 0 and "BW_H2D" in out and "measured-proxy" in out
    profile = load_profile(tmp_path / "o.json")
    assert profile.provenance.measurements["eta_method"].startswith("measured-proxy")
    assert profile.hardware.h2d_bandwidth_gb_per_s > 0


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
def test_no_gpu_without_cpu_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    term = tmp_path / "t"
    assert main(["calibrate", "hardware", "--termination-log", str(term)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--cpu" in err[0]
    assert "--cpu" in term.read_text()  # the operator sees the reason too


def test_bad_node_type_is_an_input_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "hardware", "--cpu", "--node-type", "{not json", "--termination-log", ""]) == 2
    assert "--node-type" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@gpu
def test_gpu_calibration_on_every_gpu() -> None:
    world = torch.cuda.device_count()
    settings = hw.settings_from_args(_args(iters=5), cuda_available=True, device_count=world)
    profile, full = hw.run_hardware_calibration(settings)
    m = profile.provenance.measurements
    assert m["world"] == world and len(m["h2d_gbps_contended"]) == world and len(m["eta_per_gpu"]) == world
    assert 1.0 < profile.hardware.h2d_bandwidth_gb_per_s < 1000.0
    assert math.isfinite(m["eta"]) and 0.0 <= profile.hardware.contention_eta <= 10.0
    assert 1 <= profile.hardware.compute_bound_tokens_per_expert <= 1024
    assert m["eta_method"].startswith("all-to-all" if world > 1 else "measured-proxy")
    key = profile.provenance.node_type
    assert key is not None and key.gpu_count == world and key.gpu_product and key.gpu_memory_mib > 0
    assert all(g["bus"] for g in m["gpus"])
    assert m["elapsed_s"] < 120
    assert len(hw.fit_to_termination_message(profile).encode()) <= hw.TERMINATION_LIMIT_BYTES
    assert full.hardware == profile.hardware


@pytest.mark.gpu
@gpu
def test_gpu_single_gpu_proxy() -> None:
    settings = hw.settings_from_args(_args(gpus=1, iters=5, max_tpe=256), cuda_available=True,
                                     device_count=torch.cuda.device_count())
    profile, _ = hw.run_hardware_calibration(settings)
    m = profile.provenance.measurements
    assert m["eta_method"].startswith("measured-proxy")
    assert profile.hardware.h2d_bandwidth_gb_per_s > 1.0 and math.isfinite(m["eta"])
