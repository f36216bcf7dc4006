"""The GPU path's pieces: the flag handshake primitives (:mod:`vexpert_runtime.node.gpu_sync`), grouped
GEMMs, the node's sync-free EP layer with slots streamed in through its hooks and a device routing
table switched in place, the slot memory bound, and the node benchmark's CPU twin — on the CPU in CI,
on CUDA where one is visible."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from vexpert_runtime.model.ep_moe import (
    DeviceRoutingTable,
    ExpertStacks,
    RoutingTable,
    choose_replicas,
    ep_moe_layer,
)
from vexpert_runtime.model.expert_layout import DENSE, FP8_BLOCK, expert_row_bytes
from vexpert_runtime.model.grouped_moe import group_layout, grouped_swiglu, packed_views, padded_capacity
from vexpert_runtime.model.moe_math import packed_ffn
from vexpert_runtime.node.gpu_sync import (
    FREE,
    FULL,
    CpuFlagOps,
    FlagOps,
    FlagTimeout,
    acquire,
    produce,
    release,
)
from vexpert_runtime.node.slots import SlotBuffers

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def allocate_flags(rows: int, device: str = "cpu") -> torch.Tensor:
    """FREE/FULL flags of ``rows`` layers as a node worker allocates them (shared memory on CPU)."""
    buffers = SlotBuffers.zeros(1, 1, torch.int32, rows, device)
    return buffers.share_memory_().flags if device == "cpu" else buffers.flags


@dataclasses.dataclass
class Slots:
    """Two layers' slots (``[2, vmax, D]``) and their flags: what the node's worker holds per layer."""

    slots: torch.Tensor
    flags: torch.Tensor


def fill(ops: FlagOps, stream: Any, ring: Slots, pool: torch.Tensor, seq: int, rows: list[int]) -> None:
    """The coordinator's side for layer ``seq mod 2``: the node's handshake around its copies."""
    buffer = seq % 2

    def copy_in() -> None:
        with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
            for slot, row in enumerate(rows):
                ring.slots[buffer, slot].copy_(pool[row], non_blocking=True)

    produce(ops, stream, ring.flags, buffer, copy_in)


def _reference(x: torch.Tensor, rows: torch.Tensor, local: torch.Tensor, weight: torch.Tensor, inter: int,
               hidden: int) -> torch.Tensor:
    out = torch.zeros(x.shape[0] + 1, hidden, dtype=torch.float64)
    for p in range(local.numel()):
        y = packed_ffn(x[p: p + 1].double(), rows[int(local[p])].double(), inter, hidden)
        out[p] += float(weight[p]) * y[0]
    return out


# ------------------------------------------------------------------------------------------ grouped GEMM


@pytest.mark.parametrize("grouped", [False, True])
def test_grouped_swiglu_equals_per_expert_ffn(grouped: bool) -> None:
    torch.manual_seed(0)
    experts, inter, hidden = 5, 8, 16
    storage = torch.randn(experts + 2, 3 * inter * hidden)
    rows = storage[1: experts + 1]  # a view with a storage offset, like ring.slots[b]
    local = torch.tensor([4, 0, 0, 2, 4, 4, 1, 0, 2])  # expert 3 gets nothing
    position, offs = group_layout(local, experts, align=4)
    assert offs.tolist() == [4, 8, 12, 12, 16]
    assert sorted(position.tolist()) == sorted(set(position.tolist()))  # one row per pair
    x = torch.randn(local.numel(), hidden)
    buf = torch.zeros(int(offs[-1]), hidden)
    buf[position] = x
    w13, w2 = packed_views(rows, inter, hidden)
    y = grouped_swiglu(buf, w13, w2, offs, grouped=grouped)[position]
    ref = torch.stack([packed_ffn(x[p: p + 1], rows[int(local[p])], inter, hidden)[0] for p in range(local.numel())])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_group_layout_refuses_a_buffer_too_small_and_packed_views_a_wrong_row() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        group_layout(torch.zeros(20, dtype=torch.int64), 2, align=16, capacity=16)
    with pytest.raises(ValueError, match="3·I·H"):
        packed_views(torch.zeros(2, 100), 4, 8)


# ------------------------------------------------------------------------------------------ flag protocol


def test_flags_start_free_and_a_wait_times_out_instead_of_hanging() -> None:
    flags = allocate_flags(2)
    assert flags.tolist() == [[1, 0], [1, 0]] and flags.is_shared()
    ops = CpuFlagOps(timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(FlagTimeout, match="FULL did not become 1"):
        acquire(ops, None, flags, 0)
    assert 0.2 <= time.monotonic() - started < 10.0  # bounded: it gave up, with slack for a loaded CI host


def _producer(slots: torch.Tensor, flags: torch.Tensor, sequences: int, progress: torch.Tensor) -> None:
    ops = CpuFlagOps(timeout_s=20.0)
    ring = slots.shape[0]
    for seq in range(1, sequences + 1):
        buffer = seq % ring

        def copy_in(buffer: int = buffer, seq: int = seq) -> None:
            for chunk in range(4):  # in pieces, so a reader that did not wait would see a mix
                slots[buffer, :, chunk::4].fill_(seq)
                time.sleep(0.0005)

        produce(ops, None, flags, buffer, copy_in)
        progress[0] = seq


def test_handshake_between_processes_never_exposes_a_half_filled_buffer() -> None:
    ring, sequences = 2, 60
    slots = torch.zeros(ring, 1, 4096, dtype=torch.int32).share_memory_()
    flags = allocate_flags(ring)
    progress = torch.zeros(1, dtype=torch.int64).share_memory_()
    proc = mp.get_context("spawn").Process(target=_producer, args=(slots, flags, sequences, progress))
    proc.start()
    try:
        ops = CpuFlagOps(timeout_s=20.0)
        ahead = []
        for seq in range(1, sequences + 1):
            buffer = seq % ring
            acquire(ops, None, flags, buffer)
            values = slots[buffer].unique().tolist()
            assert values == [seq], f"sequence {seq} read {values}"  # complete, and the right fill
            time.sleep(0.006)  # time for the producer to fill the other buffer, and to try this one
            ahead.append(int(progress[0]) - seq)
            assert slots[buffer].unique().tolist() == [seq]  # not overwritten while held
            release(ops, None, flags, buffer)
        proc.join(timeout=20)
        assert proc.exitcode == 0
        # The producer runs ahead (the pipeline) but never by more than the ring.
        assert max(ahead) <= ring - 1 and max(ahead) >= 1
        assert flags[:, FREE].tolist() == [1, 1] and flags[:, FULL].tolist() == [0, 0]
    finally:
        if proc.is_alive():
            proc.kill()


# ------------------------------------------------------------------------------------------ the MoE layer


def hot_copy_table(shares: list[float], experts: int, slots: int, plan_id: int = 1) -> RoutingTable:
    """One GPU holding every expert; slot 0 of each layer holds a second copy of expert 0 that takes
    ``shares[layer]`` of its pairs (the benchmark's stand-in for a replica of a hot expert)."""
    layers = len(shares)
    gpu = np.full((layers, experts, 2), -1, dtype=np.int64)
    gpu[:, :, 0] = 0
    gpu[:, 0, 1] = 0
    local = np.full_like(gpu, -1)
    local[:, :, 0] = np.arange(experts)
    local[:, 0, 1] = experts
    cum = np.full((layers, experts, 2), np.inf)
    cum[:, :, 0] = 1.0
    cum[:, 0, 0] = 1.0 - np.asarray(shares)
    cum[:, 0, 1] = 1.0
    slot_expert = np.full((layers, 1, slots), -1, dtype=np.int64)
    slot_expert[:, 0, 0] = 0
    return RoutingTable(plan_id, gpu, local, cum, slot_expert)


def _layer_setup(device: str, dtype: torch.dtype, seed: int = 0, share: float = 0.5):
    torch.manual_seed(seed)
    local_experts, vmax, inter, hidden, tokens, top_k = 3, 1, 16, 32, 20, 2
    numel = 3 * inter * hidden
    base = (torch.randn(local_experts, numel) * 0.1).to(dtype).to(device)
    pool = (torch.randn(4, numel) * 0.1).to(dtype)
    ring = Slots(torch.zeros(2, vmax, numel, dtype=dtype, device=device), allocate_flags(2, device))
    ids = torch.stack([torch.randperm(local_experts)[:top_k] for _ in range(tokens)]).to(device)
    ids[: tokens // 2, 0] = 0  # expert 0 is hot: half of its pairs go to its copy in the slot
    weights = torch.rand(tokens, top_k, device=device)
    table = DeviceRoutingTable.of(hot_copy_table([share], local_experts, vmax), device, replicas=2)
    x = (torch.randn(tokens, hidden) * 0.5).to(dtype).to(device)
    return dict(base=base, pool=pool, ring=ring, ids=ids, weights=weights, table=table, x=x, inter=inter,
                hidden=hidden, local_experts=local_experts)


def _layer(s: dict, buffer: int, ops: Any = None, grouped: bool | None = None) -> torch.Tensor:
    """ep_moe_layer on one GPU over ring buffer ``buffer``, with the GPU path's handshake as its hooks."""
    ring = s["ring"]
    stacks = ExpertStacks(s["base"], ring.slots[buffer], s["inter"], grouped=grouped)
    y, _ = ep_moe_layer(
        s["x"], s["ids"], s["weights"], s["table"], 0, stacks, None, 0, 1, None,
        slot_wait=None if ops is None else lambda: acquire(ops, None, ring.flags, buffer),
        after_compute=None if ops is None else lambda: release(ops, None, ring.flags, buffer))
    return y


def _reference(s: dict, slot_row: torch.Tensor) -> torch.Tensor:
    """Σ_k weight · expert(x) in float64, each pair through the copy :func:`choose_replicas` picks."""
    table = s["table"]
    _, local = choose_replicas(s["ids"], table.gpu[0], table.local[0], table.cum_share[0], 0, 1)
    rows = torch.cat([s["base"].cpu(), slot_row.cpu().unsqueeze(0)]).double()
    x, weights = s["x"].cpu().double(), s["weights"].cpu().double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(local.shape[1]):
            out[t] += weights[t, k] * packed_ffn(x[t: t + 1], rows[int(local[t, k])], s["inter"], s["hidden"])[0]
    return out


def test_moe_layer_with_a_streamed_slot_equals_the_reference() -> None:
    s = _layer_setup("cpu", torch.float32)
    ops = CpuFlagOps(timeout_s=10.0)
    for seq, pool_row in enumerate([2, 0, 3]):  # three layers, two slot sets: 0, 1, 0
        buffer = seq % 2
        thread = threading.Thread(target=fill, args=(ops, None, s["ring"], s["pool"], seq, [pool_row]))
        thread.start()  # the coordinator fills while the worker already runs the base experts
        y = _layer(s, buffer, ops)
        thread.join()
        torch.testing.assert_close(y.double(), _reference(s, s["pool"][pool_row]), rtol=1e-4, atol=1e-5)
    assert s["ring"].flags.tolist() == [[1, 0], [1, 0]]


def test_a_plan_switch_rewrites_the_routing_in_place() -> None:
    s = _layer_setup("cpu", torch.float32)
    table: DeviceRoutingTable = s["table"]
    s["ring"].slots[0, 0].copy_(s["pool"][1])
    pointers = [t.data_ptr() for t in (table.gpu, table.local, table.cum_share)]
    for share in (0.0, 1.0, 0.3):  # nothing, everything, some of the hot expert's pairs to the slot
        table.load(hot_copy_table([share], s["local_experts"], 1, plan_id=2))
        assert [t.data_ptr() for t in (table.gpu, table.local, table.cum_share)] == pointers
        y, stats = ep_moe_layer(s["x"], s["ids"], s["weights"], table, 0,
                                ExpertStacks(s["base"], s["ring"].slots[0], s["inter"]), None, 0, 1, None)
        torch.testing.assert_close(y.double(), _reference(s, s["pool"][1]), rtol=1e-4, atol=1e-5)
        hot = int((s["ids"] == 0).sum())
        assert int(stats.computed[-1]) == round(share * hot) or 0 < share < 1
    before = [t.clone() for t in (table.gpu, table.local, table.cum_share)]
    with pytest.raises(ValueError, match="room for 2"):  # a plan with more copies than the fixed width
        wide = hot_copy_table([0.5], s["local_experts"], 1)
        table.load(RoutingTable(3, np.concatenate([wide.gpu, wide.gpu], 2), np.concatenate([wide.local] * 2, 2),
                                np.concatenate([wide.cum_share] * 2, 2), wide.slot_expert))
    assert all(torch.equal(a, b) for a, b in zip(before, (table.gpu, table.local, table.cum_share), strict=True))


def test_a_dispatch_capacity_below_the_pairs_drops_pairs_and_says_so() -> None:
    s = _layer_setup("cpu", torch.float32, share=0.0)
    stacks = ExpertStacks(s["base"], s["ring"].slots[0], s["inter"])
    y, stats = ep_moe_layer(s["x"], s["ids"], s["weights"], s["table"], 0, stacks, None, 0, 1, None, capacity=8)
    assert int(stats.dropped) == s["ids"].numel() - 8 and int(stats.computed.sum()) == 8
    assert torch.isfinite(y).all()


def test_slot_memory_for_deepseek_v3_is_the_papers() -> None:
    # G·Vmax = 2 slots of a DeepSeek-V3 expert (bf16: 2 × 84 MiB) plus 8 bytes of flags per MoE layer:
    # the HBM the issue bounds (≤ 300 MB); block FP8 about half.
    numel = 3 * 2048 * 7168
    bf16 = SlotBuffers.zeros(2, numel, torch.bfloat16, 58, "meta")
    assert bf16.nbytes == 2 * numel * 2 + 58 * 8 + 8 and bf16.nbytes / 1e6 < 300
    fp8_row = expert_row_bytes(FP8_BLOCK, 2048, 7168, "bfloat16")
    fp8 = SlotBuffers.zeros(2, fp8_row, torch.uint8, 58, "meta")
    assert expert_row_bytes(DENSE, 2048, 7168, "bfloat16") == numel * 2
    assert 0.5 < fp8.nbytes / bf16.nbytes < 0.53


# ------------------------------------------------------------------------------------------ the benchmark's CPU twin


def test_the_node_benchmark_runs_vexpert_node_on_the_cpu_twin(tmp_path: Path) -> None:
    out = tmp_path / "gnp"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_node_path.py"), "--cpu", "--small",
                           "--iterations", "48", "--tokens", "16", "--formats", "bf16", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    streaming, prefilled = summary["bf16_streaming"], summary["bf16_prefilled"]
    row = 3 * 256 * 128 * 4  # the CPU twin computes in fp32
    assert streaming["slot_bytes_per_worker"] == prefilled["slot_bytes_per_worker"] == 2 * row
    assert streaming["iterations"] == 48 and streaming["degraded_layers"] == 0
    # 4 layers share 2 slots: each iteration under a plan re-copies; 2 layers keep theirs: only new
    # experts are copied
    assert streaming["bytes_streamed"] > prefilled["bytes_streamed"] > 0
    assert sorted(streaming["profile"]) == ["worker0-iterations43-43.json", "worker1-iterations43-43.json"]


# ------------------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA device")
def test_the_step_stream_is_above_the_shared_experts_side_stream() -> None:
    """A worker's compute stream (step_graph.step_stream) outranks a default stream such as the shared experts'
    side stream, and a graph captured on it replays (the priority the step's graphs keep)."""
    from vexpert_runtime.node.step_graph import step_stream

    stream, side = step_stream(), torch.cuda.Stream()
    assert stream.priority < side.priority
    x = torch.ones(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = x * 2
    x.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert y.tolist() == [6.0] * 4


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA device")
def test_cuda_grouped_mm_matches_the_loop() -> None:
    s = _layer_setup("cuda", torch.bfloat16)
    local = s["ids"].reshape(-1)
    position, offs = group_layout(local, s["local_experts"])
    buf = torch.zeros(padded_capacity(local.numel(), s["local_experts"]), s["hidden"], dtype=torch.bfloat16,
                      device="cuda")
    buf[position] = s["x"].repeat_interleave(2, 0)
    w13, w2 = packed_views(s["base"], s["inter"], s["hidden"])
    a = grouped_swiglu(buf, w13, w2, offs, grouped=True)[position]
    b = grouped_swiglu(buf, w13, w2, offs, grouped=False)[position]
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA device")
def test_the_layer_never_synchronises_with_the_host_and_replays_in_a_cuda_graph() -> None:
    """ep_moe_layer (world 1, grouped GEMMs): no host sync (sync debug mode raises on one), captured
    in a CUDA graph, replays equal eager runs, and a plan switch loaded into the device table between
    replays is what the next replay computes."""
    s = _layer_setup("cuda", torch.bfloat16)
    s["ring"].slots[0, 0].copy_(s["pool"][1].cuda())
    _layer(s, 0)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = _layer(s, 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _layer(s, 0)
    for share in (0.5, 0.0, 1.0):
        s["table"].load(hot_copy_table([share], s["local_experts"], 1, plan_id=2))
        graph.replay()
        expected = _layer(s, 0)
        torch.testing.assert_close(captured, expected, rtol=0, atol=0)
        torch.testing.assert_close(captured.double().cpu(), _reference(s, s["pool"][1]), rtol=5e-2, atol=5e-3)
    assert not torch.equal(eager, captured)  # share 1.0 routes differently from 0.5


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA device")
def test_cuda_stream_memops_handshake_inside_a_captured_graph() -> None:
    from vexpert_runtime.node.gpu_sync import CudaStreamMemOps

    s = _layer_setup("cuda", torch.bfloat16)
    ops = CudaStreamMemOps()
    copy_stream = torch.cuda.Stream()
    pool = s["pool"].pin_memory()
    outs: list[torch.Tensor] = []

    def two_layers() -> None:
        outs[:] = [_layer(s, 0, ops), _layer(s, 1, ops)]

    _layer(s, 0)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        two_layers()
    for it, rows in enumerate([(1, 2), (3, 0), (2, 2)]):
        graph.replay()  # waits on the GPU for the fills below
        time.sleep(0.01)
        fill(ops, copy_stream, s["ring"], pool, 2 * it, [rows[0]])
        fill(ops, copy_stream, s["ring"], pool, 2 * it + 1, [rows[1]])
        torch.cuda.synchronize()
        for out, row in zip(outs, rows, strict=True):
            torch.testing.assert_close(out.double().cpu(), _reference(s, s["pool"][row]), rtol=5e-2, atol=5e-3)
    assert s["ring"].flags.tolist() == [[1, 0], [1, 0]]


def test_a_failed_fill_hands_its_buffer_back() -> None:
    flags = allocate_flags(2)
    ops = CpuFlagOps(timeout_s=0.5)

    def broken() -> None:
        raise IndexError("pool row out of range")

    with pytest.raises(IndexError):
        produce(ops, None, flags, 0, broken)
    assert flags[0].tolist() == [1, 0]  # FREE again, not FULL
    produce(ops, None, flags, 0, lambda: None)  # the next fill of that buffer does not time out
    assert flags[0].tolist() == [0, 1]
