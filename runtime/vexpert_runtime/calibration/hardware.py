"""Hardware calibration (paper §3.2.3 and App. B.3): BW_H2D, the contention factor η and the
compute-bound tokens-per-expert threshold of a node type.

Protocol, on every GPU of the node at once (one spawned process per GPU, NCCL on 127.0.0.1):

1. **H2D alone** — copy a pinned host payload (default two bf16 experts, 2 × 3 × hidden ×
   intermediate × 2 bytes) to the GPU, all GPUs together, timed with CUDA events.
2. **All-to-all alone** — one decode-size round (dispatch + combine: two ``all_to_all_single`` of
   tokens × top_k rows of ``hidden`` bf16 per rank), and ``n`` back-to-back rounds, where ``n`` is
   chosen so that the rounds last ≥ 1.5 × the H2D copy.
3. **Both** — the H2D copy on its own stream while the ``n`` rounds run.

BW_H2D = payload / (slowest GPU's H2D time under contention) (paper Fig. 9), and
η = (T*_a2a − T_a2a) / T_h2d (paper Eq. 7), per GPU and aggregated over the node. The rounds
span the whole copy, so η is the all-to-all time lost per second of concurrent H2D traffic.
With one GPU there is no all-to-all partner: a device-to-device copy of the same size stands in
for the all-to-all and η is reported as a proxy (``eta_method``).

A MoE compute curve (one expert's SwiGLU MLP vs tokens per expert, TPE) gives the compute-bound
threshold as the knee of max(t0, slope·TPE).

The CPU twin (``--cpu``) runs the same protocol with gloo between processes: "H2D" is a copy
between two host buffers (on a thread, concurrent with the all-to-alls), the MLP runs in fp32 on
a smaller expert shape. Its numbers only exercise the code path.

The derivations are pure functions of timings (tests check them on synthetic data); torch is
imported only where the measurements run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue as queue_mod
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vexpert_runtime import __version__
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.profile import HardwareParameters, NodeTypeKey, PerformanceProfile, Provenance
from vexpert_runtime.ports import free_port

GB = 1e9  # profile bandwidths are GB/s = 1e9 B/s
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LIMIT_BYTES = 4096  # the kubelet's cap on a container termination message
DEFAULT_GPU = {"hidden": 7168, "intermediate": 2048, "tokens": 256, "top_k": 8}  # DeepSeek-V3 decode
DEFAULT_CPU = {"hidden": 1024, "intermediate": 256, "tokens": 32, "top_k": 8}  # small, for CI
DEFAULT_ITERS = 20
DEFAULT_CPU_RANKS = 2
DEFAULT_TIMEOUT_S = 300.0
COVER_MARGIN = 1.5  # all-to-all rounds last this many times the (uncontended) H2D copy
MAX_ROUNDS = 10_000
FLOOR_POINTS = 3  # smallest TPE points that set t0
SLOPE_POINTS = 3  # largest TPE points that set the compute-bound slope
FLOOR_TOLERANCE = 0.25  # a slope point must lie this far above the floor to count as compute-bound
ETA_BOUNDS = (0.0, 10.0)  # HardwareParameters.contention_eta's range
MAX_BANDWIDTH_GB_PER_S = 10_000.0
# measurements kept to the last when the termination message must shrink
ESSENTIAL_KEYS = ("device", "world", "eta_method", "eta", "h2d_gbps_contended", "elapsed_s")


class CalibrationError(RuntimeError):
    """A measurement failed (a rank crashed, timed out or could not allocate)."""


# --------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class HardwareSettings:
    """What to measure. Sizes in bytes / elements; picklable (sent to the spawned ranks)."""

    device: str  # "cuda" or "cpu"
    world: int  # ranks: GPUs, or CPU processes for the twin
    iters: int
    payload_bytes: int  # H2D copy per GPU
    hidden: int
    intermediate: int
    tokens: int  # decode tokens per rank
    top_k: int
    max_tpe: int = 1024
    warmup: int = 3
    timeout_s: float = DEFAULT_TIMEOUT_S
    cover_margin: float = COVER_MARGIN

    @property
    def dtype_bytes(self) -> int:
        """bf16 on GPU, fp32 on the CPU twin."""
        return 2 if self.device == "cuda" else 4

    @property
    def a2a_rows(self) -> int:
        """Rows each rank sends per all-to-all: tokens × top_k, rounded up to a multiple of world."""
        rows = self.tokens * self.top_k
        return -(-rows // self.world) * self.world

    @property
    def a2a_bytes(self) -> int:
        return self.a2a_rows * self.hidden * self.dtype_bytes

    @property
    def tpe_points(self) -> tuple[int, ...]:
        """1, 2, 4, … up to max_tpe (max_tpe itself included)."""
        points = [1 << i for i in range(max(1, self.max_tpe).bit_length()) if (1 << i) <= self.max_tpe]
        if points[-1] != self.max_tpe:
            points.append(self.max_tpe)
        return tuple(points)


def expert_bytes(hidden: int, intermediate: int, dtype_bytes: int) -> int:
    """Bytes of one SwiGLU expert: gate, up [hidden, intermediate] and down [intermediate, hidden]."""
    return 3 * hidden * intermediate * dtype_bytes


def settings_from_args(args: argparse.Namespace, cuda_available: bool, device_count: int) -> HardwareSettings:
    """Validate the CLI arguments of ``vexpert calibrate hardware``; bad input → VExpertInputError."""
    cpu = bool(args.cpu)
    if not cpu and not cuda_available:
        raise VExpertInputError(
            "calibrate hardware", "no CUDA GPU is visible (torch.cuda.is_available() is False)",
            "run it on a GPU node, or pass --cpu to run the CPU twin of the protocol",
        )
    defaults = DEFAULT_CPU if cpu else DEFAULT_GPU
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    for key, value in sizes.items():
        if value < 1:
            raise VExpertInputError(f"--{key.replace('_', '-')}", f"must be ≥ 1, got {value}")
    world = args.gpus if args.gpus is not None else (DEFAULT_CPU_RANKS if cpu else device_count)
    if world < 1:
        raise VExpertInputError("--gpus", f"must be ≥ 1, got {world}")
    if not cpu and world > device_count:
        raise VExpertInputError("--gpus", f"{world} requested but only {device_count} CUDA devices are visible",
                                "pass --gpus ≤ the visible GPUs, or check CUDA_VISIBLE_DEVICES")
    dtype_bytes = 4 if cpu else 2
    payload = args.expert_bytes if args.expert_bytes is not None else 2 * expert_bytes(
        sizes["hidden"], sizes["intermediate"], dtype_bytes)
    if payload < 1:
        raise VExpertInputError("--expert-bytes", f"must be ≥ 1, got {payload}")
    iters = args.iters if args.iters is not None else DEFAULT_ITERS
    if iters < 1:
        raise VExpertInputError("--iters", f"must be ≥ 1, got {iters}")
    if args.max_tpe < 2:  # the compute-bound knee is fitted on ≥ 2 sizes (1, 2, 4, …, max)
        raise VExpertInputError("--max-tpe", f"must be ≥ 2, got {args.max_tpe}", "the default is 1024")
    if args.timeout <= 0:
        raise VExpertInputError("--timeout", f"must be > 0 seconds, got {args.timeout}")
    return HardwareSettings(
        device="cpu" if cpu else "cuda", world=world, iters=iters, payload_bytes=payload,
        hidden=sizes["hidden"], intermediate=sizes["intermediate"], tokens=sizes["tokens"], top_k=sizes["top_k"],
        max_tpe=args.max_tpe, timeout_s=float(args.timeout),
    )


# ------------------------------------------------------------------------------ derivations


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


@dataclass(frozen=True)
class BandwidthResult:
    """H2D bandwidth per GPU and the node's BW_H2D (the slowest GPU's, paper Fig. 9). GB/s."""

    per_gpu_gb_per_s: tuple[float, ...]
    bandwidth_gb_per_s: float
    spread_pct: float  # 100 · (fastest − slowest) / fastest


def derive_bandwidth(payload_bytes: int, h2d_seconds: Sequence[float]) -> BandwidthResult:
    """BW_H2D = payload / max per-GPU copy time.

    ``h2d_seconds[g]``: GPU g's (median) time to copy ``payload_bytes`` host → device, seconds.
    """
    if not h2d_seconds or min(h2d_seconds) <= 0:
        raise ValueError(f"H2D times must be positive, got {list(h2d_seconds)}")
    per_gpu = tuple(payload_bytes / t / GB for t in h2d_seconds)
    spread = 100.0 * (max(per_gpu) - min(per_gpu)) / max(per_gpu)
    return BandwidthResult(per_gpu, payload_bytes / max(h2d_seconds) / GB, spread)


def derive_eta(a2a_alone_s: float, a2a_contended_s: float, h2d_s: float) -> float:
    """Paper Eq. 7: η = (T*_a2a − T_a2a) / T_h2d, unclamped (noise can make it slightly negative).

    ``a2a_alone_s``: all-to-all time without H2D traffic; ``a2a_contended_s``: the same all-to-all
    work while the H2D copy runs; ``h2d_s``: the copy's duration (the contention window). Seconds.
    """
    if h2d_s <= 0:
        raise ValueError(f"H2D time must be positive, got {h2d_s}")
    return (a2a_contended_s - a2a_alone_s) / h2d_s


@dataclass(frozen=True)
class EtaResult:
    """η per GPU and for the node (from the slowest rank's times: collectives end together)."""

    per_gpu: tuple[float, ...]
    eta: float
    spread: float  # max − min of per_gpu


def derive_eta_per_gpu(a2a_alone_s: Sequence[float], a2a_contended_s: Sequence[float],
                       h2d_s: Sequence[float]) -> EtaResult:
    """Eq. 7 per GPU g from its (median) times, and for the node from the maxima over GPUs."""
    if not (len(a2a_alone_s) == len(a2a_contended_s) == len(h2d_s) and h2d_s):
        raise ValueError("per-GPU time lists must be non-empty and of equal length")
    per_gpu = tuple(derive_eta(a, c, h) for a, c, h in zip(a2a_alone_s, a2a_contended_s, h2d_s, strict=True))
    node = derive_eta(max(a2a_alone_s), max(a2a_contended_s), max(h2d_s))
    return EtaResult(per_gpu, node, max(per_gpu) - min(per_gpu))


def a2a_rounds_to_cover(h2d_s: float, round_s: float, margin: float = COVER_MARGIN,
                        max_rounds: int = MAX_ROUNDS) -> int:
    """How many back-to-back all-to-all rounds (each ``round_s`` long) last ``margin`` × the copy."""
    if round_s <= 0 or not math.isfinite(round_s):
        return 1
    return int(min(max_rounds, max(1, math.ceil(margin * h2d_s / round_s))))


@dataclass(frozen=True)
class KneeFit:
    """The MoE compute curve as max(floor, slope · TPE)."""

    floor_s: float  # t0: median of the smallest-TPE points, seconds
    slope_s_per_token: float  # from the largest-TPE points (least squares through the origin)
    threshold: float  # t0 / slope, clipped to the measured TPE range
    clipped: bool  # True when t0/slope fell outside the measured range


def compute_bound_threshold(tpe: Sequence[float], seconds: Sequence[float], floor_points: int = FLOOR_POINTS,
                            slope_points: int = SLOPE_POINTS) -> KneeFit:
    """Knee of a MoE compute curve: the TPE where slope·TPE overtakes the flat floor t0.

    ``tpe[i]``: tokens per expert of point i; ``seconds[i]``: the expert MLP's time there.
    Below the knee the GEMMs are memory-bound (time ≈ t0), above it compute-bound (∝ TPE). The
    slope is a least-squares fit through the origin of the largest points that lie > 25 % above
    t0; if none does, the curve never left the floor and the threshold is the largest TPE.
    """
    if len(tpe) != len(seconds) or len(tpe) < 2:
        raise ValueError("need ≥ 2 (tpe, seconds) points of equal count")
    pts = sorted(zip(tpe, seconds, strict=True))
    xs = [float(x) for x, _ in pts]
    ts = [float(t) for _, t in pts]
    n_floor = max(1, min(floor_points, len(pts) - 1))
    n_slope = max(1, min(slope_points, len(pts) - n_floor))
    floor = median(ts[:n_floor])
    lo, hi = xs[0], xs[-1]
    top = [(x, t) for x, t in zip(xs[-n_slope:], ts[-n_slope:], strict=True) if t > (1 + FLOOR_TOLERANCE) * floor]
    if not top:  # the largest points are still on the floor: never compute-bound in the measured range
        return KneeFit(floor, ts[-1] / xs[-1], hi, clipped=True)
    slope = sum(x * t for x, t in top) / sum(x * x for x, _ in top)
    raw = floor / slope if slope > 0 else math.inf
    threshold = min(hi, max(lo, raw))
    return KneeFit(floor, slope, threshold, clipped=not lo <= raw <= hi)


def hardware_parameters(bandwidth_gb_per_s: float, eta: float, threshold: float) -> HardwareParameters:
    """Clamp measured values into ``HardwareParameters``' valid ranges (η ≥ 0: noise, not a gain)."""
    eta_ok = eta if math.isfinite(eta) else 0.0
    return HardwareParameters(
        h2d_bandwidth_gb_per_s=min(MAX_BANDWIDTH_GB_PER_S, bandwidth_gb_per_s),
        contention_eta=min(ETA_BOUNDS[1], max(ETA_BOUNDS[0], eta_ok)),
        compute_bound_tokens_per_expert=max(threshold, 1e-6),
    )


# --------------------------------------------------------------------- termination message


def fit_to_termination_message(profile: PerformanceProfile, limit: int = TERMINATION_LIMIT_BYTES) -> str:
    """The profile as compact JSON of at most ``limit`` UTF-8 bytes.

    Drops measurements, largest first and ``ESSENTIAL_KEYS`` last, until it fits; adds
    ``"trimmed": true`` when anything was dropped. The parameters themselves are never touched.
    """
    text = profile.model_dump_json()
    if len(text.encode()) <= limit:
        return text
    kept = dict(profile.provenance.measurements)
    kept.pop("details", None)

    def rank(key: str) -> tuple[int, int]:
        essential = ESSENTIAL_KEYS.index(key) if key in ESSENTIAL_KEYS else -1
        return (essential, -len(json.dumps(kept[key], default=str)))

    order = sorted(kept, key=rank)
    while True:
        trimmed = profile.model_copy(update={
            "provenance": profile.provenance.model_copy(update={"measurements": {**kept, "trimmed": True}})})
        text = trimmed.model_dump_json()
        if len(text.encode()) <= limit:
            return text
        if not order:
            raise ValueError(f"the profile alone exceeds {limit} bytes")
        kept.pop(order.pop(0))


def default_termination_log(env: Mapping[str, str] | None = None, path: str = TERMINATION_LOG) -> str | None:
    """``/dev/termination-log`` in a Kubernetes container (the kubelet creates the file), else None.

    Outside Kubernetes the file is only written if it already exists and is writable, so a run on
    a workstation as root does not litter /dev.
    """
    source = os.environ if env is None else env
    target = Path(path)
    if target.is_file() and os.access(target, os.W_OK):
        return path
    in_pod = bool(source.get("KUBERNETES_SERVICE_HOST"))
    if in_pod and target.parent.is_dir() and os.access(target.parent, os.W_OK):
        return path
    return None


def write_termination_message(path: str | None, text: str) -> bool:
    """Write the message (a profile JSON or a one-line failure reason); False if it could not."""
    if not path:
        return False
    try:
        Path(path).write_text(text)
    except OSError as exc:
        print(f"warning: could not write the termination message to {path}: {exc}", file=sys.stderr)
        return False
    return True


# ------------------------------------------------------------------------------ measurement


class _Rig:
    """One rank's buffers, streams and timed operations. All times returned in seconds."""

    def __init__(self, settings: HardwareSettings, rank: int) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.cuda = settings.device == "cuda"
        self.world = settings.world
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        dtype = torch.bfloat16 if self.cuda else torch.float32
        self.src = torch.empty(settings.payload_bytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.src.fill_(1)  # touch every page before timing
        self.dst = torch.empty(settings.payload_bytes, dtype=torch.uint8, device=self.device)
        gen = torch.Generator().manual_seed(rank)
        self.send = torch.randn(settings.a2a_rows, settings.hidden, generator=gen).to(self.device, dtype)
        self.recv = torch.empty_like(self.send)
        self.back = torch.empty_like(self.send)
        self.flag = torch.zeros(1, device=self.device)
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def sync(self) -> None:
        """All ranks idle and lined up (a tiny all-reduce, then a device synchronize)."""
        if self.world > 1:
            self.dist.all_reduce(self.flag)
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def reduce_max(self, value: float) -> float:
        """The maximum of ``value`` over ranks (so every rank picks the same round count)."""
        if self.world == 1:
            return value
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def a2a_round(self) -> None:
        """Dispatch + combine: two all_to_all_single (one GPU: two local copies as the proxy load)."""
        if self.world > 1:
            self.dist.all_to_all_single(self.recv, self.send)
            self.dist.all_to_all_single(self.back, self.recv)
        else:
            self.recv.copy_(self.send)
            self.back.copy_(self.recv)

    def _host_copy(self) -> float:
        start = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - start

    def h2d_alone(self) -> float:
        self.sync()
        if not self.cuda:
            return self._host_copy()
        e0, e1 = self.events[:2]
        with self.torch.cuda.stream(self.copy_stream):
            e0.record(self.copy_stream)
            self.dst.copy_(self.src, non_blocking=True)
            e1.record(self.copy_stream)
        self.copy_stream.synchronize()
        return float(e0.elapsed_time(e1)) / 1e3

    def rounds(self, n: int) -> float:
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(n):
                self.a2a_round()
            return time.perf_counter() - start
        a0, a1 = self.events[2:]
        a0.record()
        for _ in range(n):
            self.a2a_round()
        a1.record()
        self.torch.cuda.synchronize(self.device)
        return float(a0.elapsed_time(a1)) / 1e3

    def contended(self, n: int) -> tuple[float, float]:
        """(H2D copy time, time of n all-to-all rounds) with both running at once."""
        self.sync()
        if not self.cuda:
            box: list[float] = []
            thread = threading.Thread(target=lambda: box.append(self._host_copy()))
            start = time.perf_counter()
            thread.start()
            for _ in range(n):
                self.a2a_round()
            a2a = time.perf_counter() - start
            thread.join()
            return box[0], a2a
        e0, e1, a0, a1 = self.events
        with self.torch.cuda.stream(self.copy_stream):
            e0.record(self.copy_stream)
            self.dst.copy_(self.src, non_blocking=True)
            e1.record(self.copy_stream)
        a0.record()
        for _ in range(n):
            self.a2a_round()
        a1.record()
        self.torch.cuda.synchronize(self.device)
        return float(e0.elapsed_time(e1)) / 1e3, float(a0.elapsed_time(a1)) / 1e3


def moe_compute_curve(settings: HardwareSettings, device_index: int = 0) -> tuple[list[list[float]], str]:
    """Seconds per call of one expert's SwiGLU MLP, ``silu(x@Wg) * (x@Wu) @ Wd``, per TPE point.

    x: [TPE, hidden]; Wg, Wu: [hidden, intermediate]; Wd: [intermediate, hidden]. bf16 on GPU,
    timed by replaying a CUDA graph of 10 calls (as deployed; eager if capture fails); fp32 on CPU.
    Returns ([[tpe, seconds], ...], timing method).
    """
    import torch
    import torch.nn.functional as F

    cuda = settings.device == "cuda"
    device = torch.device("cuda", device_index) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    scale = settings.hidden ** -0.5
    wg = (torch.randn(settings.hidden, settings.intermediate, generator=gen) * scale).to(device, dtype)
    wu = (torch.randn(settings.hidden, settings.intermediate, generator=gen) * scale).to(device, dtype)
    wd = (torch.randn(settings.intermediate, settings.hidden, generator=gen) * scale).to(device, dtype)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ wg) * (x @ wu)) @ wd

    curve: list[list[float]] = []
    method = "cuda-graph" if cuda else "cpu-eager"
    for tpe in settings.tpe_points:
        x = torch.randn(tpe, settings.hidden, generator=gen).to(device, dtype)
        if not cuda:
            mlp(x)
            samples: list[float] = []
            budget = time.perf_counter() + 0.05
            while len(samples) < 3 or (time.perf_counter() < budget and len(samples) < 50):
                start = time.perf_counter()
                mlp(x)
                samples.append(time.perf_counter() - start)
            curve.append([tpe, median(samples)])
            continue
        seconds = _time_cuda(mlp, x, reps=10, use_graph=method == "cuda-graph")
        if seconds is None:  # capture failed: fall back to eager for every point
            method = "cuda-eager"
            seconds = _time_cuda(mlp, x, reps=10, use_graph=False)
        assert seconds is not None
        curve.append([tpe, seconds])
    return curve, method


def _time_cuda(fn: Callable[[Any], Any], x: Any, reps: int, use_graph: bool, trials: int = 5) -> float | None:
    """Median seconds per call of ``fn(x)`` over ``trials`` runs of ``reps`` calls (None: no graph)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = None
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn(x)
            graph.replay()
            torch.cuda.synchronize()
        except Exception:
            torch.cuda.synchronize()
            return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(trials):
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(reps):
                fn(x)
        end.record()
        torch.cuda.synchronize()
        samples.append(float(start.elapsed_time(end)) / 1e3 / reps)
    return median(samples)


def _measure_rank(rank: int, settings: HardwareSettings, port: int) -> dict[str, Any]:
    """Run the protocol on one rank; rank 0 then also measures the compute curve."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    from vexpert_runtime.calibration.nodeinfo import torch_gpu_facts

    cuda = settings.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    if settings.world > 1:
        kwargs: dict[str, Any] = {"device_id": torch.device("cuda", rank)} if cuda else {}
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=settings.world, timeout=dt.timedelta(seconds=settings.timeout_s), **kwargs)
    out: dict[str, Any] = {"rank": rank, "facts": torch_gpu_facts(rank) if cuda else {"index": rank}}
    try:
        rig = _Rig(settings, rank)
        for _ in range(settings.warmup):
            rig.h2d_alone()
            rig.rounds(1)
        out["h2d_alone_s"] = [rig.h2d_alone() for _ in range(settings.iters)]
        out["round_alone_s"] = [rig.rounds(1) for _ in range(settings.iters)]
        n = a2a_rounds_to_cover(rig.reduce_max(median(out["h2d_alone_s"])),
                                rig.reduce_max(median(out["round_alone_s"])), settings.cover_margin)
        out["a2a_rounds"] = n
        rig.contended(n)  # warm-up of the concurrent path
        alone, h2d, cont = [], [], []
        for _ in range(settings.iters):  # interleaved, so drift (clocks, other tenants) hits both
            alone.append(rig.rounds(n))
            copy_s, a2a_s = rig.contended(n)
            h2d.append(copy_s)
            cont.append(a2a_s)
        out.update(rounds_alone_s=alone, h2d_contended_s=h2d, rounds_contended_s=cont)
        rig.sync()
        del rig
    finally:
        if settings.world > 1:
            dist.destroy_process_group()
    if rank == 0:
        out["curve"], out["curve_timing"] = moe_compute_curve(settings, 0)
    return out


def _worker(rank: int, settings: HardwareSettings, port: int, results: Any) -> None:
    """Process entry of one rank: puts its result dict, or {"rank", "error"}, on ``results``."""
    try:
        results.put(_measure_rank(rank, settings, port))
    except BaseException as exc:
        results.put({"rank": rank, "error": f"rank {rank}: {type(exc).__name__}: {' '.join(str(exc).split())}"})


def run_ranks(settings: HardwareSettings) -> list[dict[str, Any]]:
    """Spawn one process per rank, wait for every result (or the first error / the timeout)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, settings, port, results), name=f"vexpert-calibrate-{r}",
                         daemon=True) for r in range(settings.world)]
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + settings.timeout_s
    try:
        for proc in procs:
            proc.start()
        while len(got) < settings.world:
            try:
                item = results.get(timeout=0.5)
            except queue_mod.Empty:
                missing = [r for r in range(settings.world) if r not in got]
                dead = [(r, procs[r].exitcode) for r in missing if procs[r].exitcode not in (None, 0)]
                if dead:
                    raise CalibrationError(f"rank {dead[0][0]} exited with code {dead[0][1]} before reporting") from None
                if time.monotonic() > deadline:
                    raise CalibrationError(f"timed out after {settings.timeout_s:.0f} s waiting for ranks {missing}") from None
                continue
            if "error" in item:
                raise CalibrationError(item["error"])
            got[int(item["rank"])] = item
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.cancel_join_thread()
        results.close()
    return [got[r] for r in range(settings.world)]


# --------------------------------------------------------------------------------- assembly


def _sig(value: float, digits: int = 4) -> float:
    """Round to ``digits`` significant digits (keeps the termination message small)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def _ms(seconds: Sequence[float]) -> list[float]:
    return [_sig(s * 1e3) for s in seconds]


def eta_method(settings: HardwareSettings) -> str:
    """How η was measured, in words (stored with the profile)."""
    if settings.world > 1:
        backend = "NCCL" if settings.device == "cuda" else "gloo (CPU twin)"
        return f"all-to-all: {settings.world} ranks over {backend}, Eq. 7"
    what = "device-to-device copy" if settings.device == "cuda" else "host copy (CPU twin)"
    return f"measured-proxy: 1 rank has no all-to-all partner; a local {what} of the all-to-all size stands in"


def build_result(settings: HardwareSettings, ranks: list[dict[str, Any]], node: Any, node_type: NodeTypeKey,
                 elapsed_s: float) -> tuple[PerformanceProfile, PerformanceProfile]:
    """(profile with the small measurements, profile with full details) from the ranks' raw times.

    ``node``: a ``nodeinfo.NodeInfo``. Both profiles carry the same parameters.
    """
    h2d_alone = [median(r["h2d_alone_s"]) for r in ranks]
    h2d_cont = [median(r["h2d_contended_s"]) for r in ranks]
    round_alone = [median(r["round_alone_s"]) for r in ranks]
    rounds_alone = [median(r["rounds_alone_s"]) for r in ranks]
    rounds_cont = [median(r["rounds_contended_s"]) for r in ranks]
    n = int(ranks[0]["a2a_rounds"])
    bw_alone = derive_bandwidth(settings.payload_bytes, h2d_alone)
    bw = derive_bandwidth(settings.payload_bytes, h2d_cont)
    eta = derive_eta_per_gpu(rounds_alone, rounds_cont, h2d_cont)
    curve = ranks[0]["curve"]
    knee = compute_bound_threshold([p[0] for p in curve], [p[1] for p in curve])
    params = hardware_parameters(bw.bandwidth_gb_per_s, eta.eta, knee.threshold)
    gpus = node.gpus if settings.device == "cuda" else []
    first = gpus[0] if gpus else None
    small: dict[str, Any] = {
        "device": settings.device,
        "world": settings.world,
        "eta_method": eta_method(settings),
        "eta": _sig(eta.eta),
        "eta_per_gpu": [_sig(e) for e in eta.per_gpu],
        "eta_spread": _sig(eta.spread),
        "h2d_gbps_contended": [_sig(b) for b in bw.per_gpu_gb_per_s],
        "h2d_gbps_alone": [_sig(b) for b in bw_alone.per_gpu_gb_per_s],
        "h2d_spread_pct": _sig(bw.spread_pct, 3),
        "h2d_slowdown_pct": _sig(100.0 * (1 - bw.bandwidth_gb_per_s / bw_alone.bandwidth_gb_per_s), 3),
        "payload_bytes": settings.payload_bytes,
        # Per round within the same back-to-back sequence, so alone and contended compare directly.
        "a2a_ms": _ms([a / n for a in rounds_alone]),
        "a2a_ms_contended": _ms([c / n for c in rounds_cont]),
        "a2a_single_round_ms": _ms(round_alone),
        "a2a_rounds": n,
        "a2a_covers_h2d": bool(min(rounds_cont) >= max(h2d_cont)),
        "a2a_bytes_per_rank": settings.a2a_bytes,
        "iters": settings.iters,
        "compute_tpe": [int(p[0]) for p in curve],
        "compute_ms": _ms([p[1] for p in curve]),
        "compute_floor_ms": _sig(knee.floor_s * 1e3),
        "compute_slope_us_per_token": _sig(knee.slope_s_per_token * 1e6),
        "compute_threshold_clipped": knee.clipped,
        "compute_timing": ranks[0].get("curve_timing", ""),
        "expert_shape": [settings.hidden, settings.intermediate],
        "gpu_name": first.name if first else None,
        "gpus": [{"bus": g.bus_id, "numa": g.numa_node,
                  "link": f"{g.link_speed} x{g.link_width}" if g.link_speed else None} for g in gpus],
        "host_memory_gib": _sig(node.host_memory_bytes / 2**30) if node.host_memory_bytes else None,
        "numa_nodes": node.numa_nodes,
        "driver_version": node.driver_version,
        "elapsed_s": round(elapsed_s, 2),
    }
    provenance = Provenance(source="hardware-calibration", tool_version=__version__, node_type=node_type,
                            measurements=small)
    profile = PerformanceProfile(hardware=params, provenance=provenance)
    details = {
        "settings": asdict(settings),
        "node": node.as_dict(),
        "ranks": [{
            "rank": r["rank"],
            "facts": r.get("facts"),
            **{f"{key[:-2]}_ms": _ms(r[key]) for key in
               ("h2d_alone_s", "round_alone_s", "rounds_alone_s", "h2d_contended_s", "rounds_contended_s")},
        } for r in ranks],
        "curve_s": curve,
        "eta_node_raw": eta.eta,
        "knee": asdict(knee),
    }
    full = profile.model_copy(update={
        "provenance": provenance.model_copy(update={"measurements": {**small, "details": details}})})
    return profile, full


def run_hardware_calibration(settings: HardwareSettings, node_type: NodeTypeKey | None = None,
                             log: Callable[[str], None] | None = None) -> tuple[PerformanceProfile, PerformanceProfile]:
    """Measure this node; returns (profile for stdout / termination message, profile with details).

    ``node_type``: the key the operator asked for (``--node-type``); detected from the node if None.
    """
    from vexpert_runtime.calibration.nodeinfo import collect_node_info, node_type_key

    started = time.perf_counter()
    if log:
        log(f"measuring on {settings.world} {settings.device} rank(s): payload {settings.payload_bytes / 1e6:.1f} MB, "
            f"all-to-all {settings.a2a_bytes / 1e6:.1f} MB/rank, {settings.iters} iterations")
    ranks = run_ranks(settings)
    node = collect_node_info([r["facts"] for r in ranks] if settings.device == "cuda" else [])
    if node_type is None:
        node_type = node_type_key(node) if settings.device == "cuda" else NodeTypeKey(
            gpu_product="cpu-twin", instance_type=node.instance_type or "")
    return build_result(settings, ranks, node, node_type, time.perf_counter() - started)


def format_summary(profile: PerformanceProfile) -> str:
    """A few human lines about a hardware-calibration profile."""
    m = profile.provenance.measurements
    hw = profile.hardware
    name = m.get("gpu_name") or ("CPU twin" if m.get("device") == "cpu" else "GPU")

    def join(values: Sequence[Any], fmt: str) -> str:
        return " ".join(format(v, fmt) for v in values)

    lines = [
        f"vexpert calibrate hardware: {m.get('world')}× {name} ({m.get('device')}), "
        f"payload {m.get('payload_bytes', 0) / 1e6:.1f} MB, {m.get('iters')} iterations, {m.get('elapsed_s')} s",
        f"  H2D alone       {join(m.get('h2d_gbps_alone', []), '.1f')} GB/s per GPU",
        f"  H2D contended   {join(m.get('h2d_gbps_contended', []), '.1f')} GB/s per GPU → "
        f"BW_H2D = {hw.h2d_bandwidth_gb_per_s:.1f} GB/s (slowest GPU; spread {m.get('h2d_spread_pct')} %)",
        f"  all-to-all      {join(m.get('a2a_ms', []), '.3f')} ms alone, "
        f"{join(m.get('a2a_ms_contended', []), '.3f')} ms under H2D (per round; {m.get('a2a_rounds')} back-to-back)",
        f"  η               {hw.contention_eta:.3f} (per GPU {join(m.get('eta_per_gpu', []), '.3f')}; "
        f"{m.get('eta_method')})",
        f"  compute-bound   TPE ≥ {hw.compute_bound_tokens_per_expert:.0f} (floor {m.get('compute_floor_ms')} ms, "
        f"slope {m.get('compute_slope_us_per_token')} µs/token"
        f"{', clipped to the measured range' if m.get('compute_threshold_clipped') else ''})",
    ]
    return "\n".join(lines)
