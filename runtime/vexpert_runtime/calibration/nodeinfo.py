"""Facts about the node a calibration runs on: host DRAM, NUMA nodes, GPUs and their PCIe links.

Everything here reads ``/proc``, ``/sys`` or ``nvidia-smi`` and never raises: anything that cannot
be read becomes ``None`` (JSON ``null``). Only :func:`torch_gpu_facts` imports torch (inside the
function), so the module itself is torch-free.

The node type key follows NVIDIA GPU feature discovery, whose labels the operator uses to group
nodes: ``nvidia.com/gpu.product`` is the NVML name with spaces replaced by ``-``, and
``nvidia.com/gpu.memory`` is NVML's total memory in MiB (what ``nvidia-smi`` reports, a little
more than CUDA's ``totalGlobalMem``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vexpert_runtime.policy.profile import NodeTypeKey

MEMINFO = "/proc/meminfo"
NODE_ROOT = "/sys/devices/system/node"
PCI_ROOT = "/sys/bus/pci/devices"
INSTANCE_TYPE_ENV = ("VEXPERT_INSTANCE_TYPE", "NODE_INSTANCE_TYPE")
NVIDIA_SMI_TIMEOUT_S = 10.0
MIB = 1 << 20

_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


@dataclass
class GpuInfo:
    """One GPU as this process sees it (``index`` is the CUDA device index)."""

    index: int
    name: str | None = None
    memory_mib: int | None = None
    bus_id: str | None = None  # "00000000:19:00.0" form: lower case, 8-hex-digit domain
    numa_node: int | None = None  # None when unknown or when sysfs says -1 (no affinity)
    link_speed: str | None = None  # sysfs current_link_speed, e.g. "32.0 GT/s PCIe"
    link_width: int | None = None  # sysfs current_link_width (lanes)
    max_link_speed: str | None = None
    max_link_width: int | None = None


@dataclass
class NodeInfo:
    """The node's facts; every field may be ``None`` when it could not be read."""

    host_memory_bytes: int | None = None
    numa_nodes: list[int] | None = None
    driver_version: str | None = None
    instance_type: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------- host


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def host_memory_bytes(meminfo: str | Path = MEMINFO) -> int | None:
    """Total host DRAM in bytes (``MemTotal`` of /proc/meminfo, which is in KiB)."""
    text = _read(meminfo)
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            kib = _int_or_none(parts[1]) if len(parts) > 1 else None
            return kib * 1024 if kib is not None else None
    return None


def numa_nodes(root: str | Path = NODE_ROOT) -> list[int] | None:
    """Ids of the NUMA nodes (``nodeN`` directories under /sys/devices/system/node), sorted."""
    try:
        names = [p.name for p in Path(root).iterdir()]
    except OSError:
        return None
    ids = sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())
    return ids or None


def instance_type(env: Mapping[str, str] | None = None) -> str | None:
    """The cloud instance type from ``VEXPERT_INSTANCE_TYPE`` or ``NODE_INSTANCE_TYPE`` (first set)."""
    source = os.environ if env is None else env
    for key in INSTANCE_TYPE_ENV:
        value = source.get(key, "").strip()
        if value:
            return value
    return None


# -------------------------------------------------------------------------------------- PCI


def normalize_bus_id(bus_id: str) -> str | None:
    """A PCI address as ``dddddddd:bb:dd.f`` in lower case (8-hex-digit domain, as NVML prints it).

    Accepts NVML's ``00000000:19:00.0``, sysfs' ``0000:19:00.0`` and a bare ``19:00.0``.
    """
    match = _BUS_ID.match(bus_id.strip())
    if not match:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):08x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def pci_sysfs_dir(bus_id: str, root: str | Path = PCI_ROOT) -> Path | None:
    """The sysfs directory of a PCI device: tries the 8-digit and the usual 4-digit domain form."""
    norm = normalize_bus_id(bus_id)
    if norm is None:
        return None
    domain, rest = norm.split(":", 1)
    candidates = [norm, f"{int(domain, 16):04x}:{rest}"]
    for name in candidates:
        path = Path(root) / name
        if path.is_dir():
            return path
    return None


def pci_link(bus_id: str | None, root: str | Path = PCI_ROOT) -> dict[str, Any]:
    """NUMA affinity and PCIe link of one device: numa_node (None for -1), link speed/width."""
    out: dict[str, Any] = {
        "numa_node": None, "link_speed": None, "link_width": None, "max_link_speed": None, "max_link_width": None,
    }
    path = pci_sysfs_dir(bus_id, root) if bus_id else None
    if path is None:
        return out
    numa = _int_or_none(_read(path / "numa_node"))
    out["numa_node"] = numa if numa is not None and numa >= 0 else None
    out["link_speed"] = _read(path / "current_link_speed") or None
    out["link_width"] = _int_or_none(_read(path / "current_link_width"))
    out["max_link_speed"] = _read(path / "max_link_speed") or None
    out["max_link_width"] = _int_or_none(_read(path / "max_link_width"))
    return out


# ---------------------------------------------------------------------------------- drivers


def parse_nvidia_smi_csv(text: str) -> list[dict[str, Any]]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id
    --format=csv,noheader,nounits`` as dicts (memory in MiB); malformed rows are skipped."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        index = _int_or_none(parts[0])
        if index is None:
            continue
        rows.append({
            "index": index,
            "name": parts[1] or None,
            "memory_mib": _int_or_none(parts[2]),
            "driver_version": parts[3] or None,
            "bus_id": normalize_bus_id(parts[4]),
        })
    return rows


def nvidia_smi_gpus(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> list[dict[str, Any]] | None:
    """All GPUs as ``nvidia-smi`` lists them (PCI order, ignores CUDA_VISIBLE_DEVICES); None if absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,driver_version,pci.bus_id", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return parse_nvidia_smi_csv(proc.stdout) or None


def driver_version(smi_rows: list[dict[str, Any]] | None = None) -> str | None:
    """The NVIDIA driver version (pynvml if installed, else nvidia-smi); None without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # not installed, no driver, no permission: fall back
        pass
    rows = smi_rows if smi_rows is not None else nvidia_smi_gpus()
    for row in rows or []:
        if row.get("driver_version"):
            return str(row["driver_version"])
    return None


# ------------------------------------------------------------------------------------- GPUs


def torch_gpu_facts(device_index: int) -> dict[str, Any]:
    """Name, memory (MiB, CUDA's total) and PCI bus id of one CUDA device, as torch sees it.

    Call it in the process that owns the device (it initialises CUDA there).
    """
    import torch

    facts: dict[str, Any] = {"index": device_index, "name": None, "memory_mib": None, "bus_id": None}
    try:
        props = torch.cuda.get_device_properties(device_index)
    except Exception:
        return facts
    facts["name"] = getattr(props, "name", None)
    total = getattr(props, "total_memory", None)
    facts["memory_mib"] = int(total) // MIB if total else None
    domain, bus, device = (getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
    if bus is not None and device is not None:
        facts["bus_id"] = f"{int(domain or 0):08x}:{int(bus):02x}:{int(device):02x}.0"
    return facts


def merge_gpu_facts(torch_facts: list[dict[str, Any]], smi_rows: list[dict[str, Any]] | None,
                    pci_root: str | Path = PCI_ROOT) -> list[GpuInfo]:
    """One ``GpuInfo`` per CUDA device: torch's facts, NVML's name/memory where the bus ids match
    (so ``memory_mib`` is the GPU feature discovery value), and the device's sysfs PCIe link."""
    by_bus = {row["bus_id"]: row for row in smi_rows or [] if row.get("bus_id")}
    gpus = []
    for facts in torch_facts:
        bus = facts.get("bus_id")
        smi = by_bus.get(bus) if bus else None
        if smi is None and smi_rows and len(smi_rows) == len(torch_facts) and not bus:
            smi = next((r for r in smi_rows if r["index"] == facts["index"]), None)
        bus = bus or (smi or {}).get("bus_id")
        gpus.append(GpuInfo(
            index=int(facts["index"]),
            name=(smi or {}).get("name") or facts.get("name"),
            memory_mib=(smi or {}).get("memory_mib") or facts.get("memory_mib"),
            bus_id=bus,
            **pci_link(bus, pci_root),
        ))
    return gpus


def collect_node_info(torch_facts: list[dict[str, Any]] | None = None,
                      env: Mapping[str, str] | None = None) -> NodeInfo:
    """Everything this module knows about the node; ``torch_facts`` come from the GPU workers."""
    smi = nvidia_smi_gpus()
    return NodeInfo(
        host_memory_bytes=host_memory_bytes(),
        numa_nodes=numa_nodes(),
        driver_version=driver_version(smi),
        instance_type=instance_type(env),
        gpus=merge_gpu_facts(torch_facts or [], smi),
    )


def gfd_product(name: str | None) -> str:
    """GPU feature discovery's ``nvidia.com/gpu.product`` value for an NVML name."""
    return "-".join((name or "").split())


def node_type_key(info: NodeInfo) -> NodeTypeKey:
    """The node type this calibration describes, in the operator's terms (GFD labels)."""
    first = info.gpus[0] if info.gpus else None
    return NodeTypeKey(
        gpu_product=gfd_product(first.name if first else None),
        gpu_count=len(info.gpus),
        gpu_memory_mib=int(first.memory_mib or 0) if first else 0,
        driver_version=info.driver_version or "",
        instance_type=info.instance_type or "",
    )
