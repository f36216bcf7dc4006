"""Slot transport: how the coordinator reaches the workers' L1 slots and their flags.

A worker's L1 is a :class:`~vexpert_runtime.node.slots.SlotBuffers`: the slot rows ``[S, D]``, the
per-layer handshake flags ``[L, 2]`` int32 and two progress counters, all on the worker's device.
The protocol (:mod:`vexpert_runtime.node.protocol`) needs:

* worker side: :meth:`SlotTransport.allocate` makes the buffers and :meth:`SlotTransport.export`
  turns them into something that crosses a ``torch.multiprocessing`` queue;
* coordinator side: :meth:`SlotTransport.open` maps a worker's buffers, :meth:`SlotTransport.host_buffer`
  allocates L2 pool memory, :meth:`SlotTransport.stream` is the stream every copy and flag operation
  into one worker is ordered on, :meth:`SlotTransport.copy` enqueues one expert copy on it, and
  :meth:`SlotTransport.flag_ops` waits on / writes the flags in that order.

:class:`CpuSharedMemoryTransport` is the CPU twin: buffers are shared-memory tensors (torch's
``file_descriptor`` strategy: the /dev/shm file is unlinked at creation, so nothing can leak), a copy
is ``copy_`` and a flag wait polls. :class:`CudaIpcTransport` is the GPU path: buffers in the
worker's HBM shared through CUDA IPC, pinned host pool, asynchronous copies on one copy stream per
GPU, flags waited on and written by the GPU itself (``cuStreamWaitValue32``/``cuStreamWriteValue32``),
so neither side's CPU waits for the other.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.node.gpu_sync import CpuFlagOps, CudaStreamMemOps, FlagOps
from vexpert_runtime.node.slots import SlotBuffers


class SlotTransport(ABC):
    """Moves packed expert rows from the coordinator's L2 pool into workers' L1 slots."""

    kind: str = ""
    # How many iterations past the last one every worker finished the coordinator may publish
    # (protocol.AHEAD at most). Where the fills wait for slots on the device (CUDA) it is 3: a worker
    # that overlaps iterations reports t − 2 finished just before it starts t, and a lower bound would
    # make every iteration wait for the coordinator. Where the fills' waits poll host memory (CPU) it
    # is 2: CPU workers report each iteration before the next, and a fill loop further ahead would
    # only spend the workers' cores polling flags it cannot take yet.
    publish_ahead: int = 2

    @abstractmethod
    def allocate(self, slots: int, numel: int, dtype: torch.dtype, layers: int) -> SlotBuffers:
        """Worker: zeroed slots [S, numel], flags [L, 2] all FREE, progress [2] (see :class:`SlotBuffers`)."""

    def export(self, buffers: SlotBuffers) -> Any:
        """Worker: a handle for the coordinator (sent through a torch.multiprocessing queue)."""
        return buffers

    def open(self, handle: Any) -> SlotBuffers:
        """Coordinator: the worker's buffers from its handle."""
        buffers: SlotBuffers = handle
        return buffers

    @abstractmethod
    def host_buffer(self, rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Coordinator: L2 pool memory [rows, numel] (pinned where it speeds up copies)."""

    def stream(self, buffers: SlotBuffers) -> Any:
        """The stream copies and flag operations into ``buffers`` are ordered on (None on CPU)."""
        return None

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Coordinator: enqueue dst ← src for one expert row (on :meth:`stream` of dst's buffers)."""

    @abstractmethod
    def flag_ops(self, interrupted: Callable[[], bool]) -> FlagOps:
        """Flag operations for these buffers; CPU waits give up (:class:`~vexpert_runtime.node.gpu_sync.FlagWaitInterrupted`)
        once ``interrupted()`` is true."""

    def drain(self, buffers: SlotBuffers, timeout_s: float | None = None) -> bool:
        """Coordinator: wait until everything enqueued into ``buffers`` has run (at most ``timeout_s``);
        whether it has."""
        return True


class CpuSharedMemoryTransport(SlotTransport):
    """CPU twin: buffers are shared-memory tensors, copies are synchronous memcpy, waits poll."""

    kind = "cpu-shm"

    def allocate(self, slots: int, numel: int, dtype: torch.dtype, layers: int) -> SlotBuffers:
        return SlotBuffers.zeros(slots, numel, dtype, layers, "cpu").share_memory_()

    def host_buffer(self, rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(rows, numel, dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def flag_ops(self, interrupted: Callable[[], bool]) -> FlagOps:
        return CpuFlagOps(timeout_s=None, interrupted=interrupted)


@dataclass(frozen=True)
class CudaSlotHandle:
    """A worker's buffers as ``torch.multiprocessing``'s CUDA IPC reductions (plain data)."""

    slots: tuple[Any, ...]
    flags: tuple[Any, ...]
    progress: tuple[Any, ...]


class CudaIpcTransport(SlotTransport):
    """GPU path: buffers live in each worker's HBM and reach the coordinator through CUDA IPC
    (torch.multiprocessing shares CUDA tensors that way); the pool is pinned host memory and each
    worker's copies and flag operations go on one copy stream. Only constructed where CUDA exists."""

    kind = "cuda-ipc"
    publish_ahead = 3

    def __init__(self, device_index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise VExpertInputError(
                "runtime.device",
                "cuda was requested but no CUDA device is visible",
                "set runtime.device: cpu (or pass --cpu-workers N), or run on a GPU node",
            )
        self.device = torch.device("cuda", device_index)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._ops: CudaStreamMemOps | None = None

    def export(self, buffers: SlotBuffers) -> Any:
        """The CUDA IPC handles as plain data: the node passes them on to every coordinator process it
        starts without opening them (a tensor received over IPC cannot be sent on, and the node needs
        no CUDA context for them)."""
        from torch.multiprocessing.reductions import reduce_tensor

        return CudaSlotHandle(*(tuple(reduce_tensor(t)[1]) for t in (buffers.slots, buffers.flags, buffers.progress)))

    def open(self, handle: Any) -> SlotBuffers:
        if isinstance(handle, SlotBuffers):
            return handle
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return SlotBuffers(*(rebuild_cuda_tensor(*args) for args in (handle.slots, handle.flags, handle.progress)))

    def allocate(self, slots: int, numel: int, dtype: torch.dtype, layers: int) -> SlotBuffers:
        buffers = SlotBuffers.zeros(slots, numel, dtype, layers, self.device)
        # The initial values are written by this process's stream; the coordinator's stream (another
        # process) must not race them.
        torch.cuda.synchronize(self.device)
        return buffers

    def host_buffer(self, rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(rows, numel, dtype=dtype, pin_memory=True)

    def stream(self, buffers: SlotBuffers) -> torch.cuda.Stream:
        index = buffers.slots.device.index or 0
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=buffers.slots.device)
        return self._streams[index]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        index = dst.device.index or 0
        with torch.cuda.stream(self._streams[index]):
            dst.copy_(src, non_blocking=True)

    def flag_ops(self, interrupted: Callable[[], bool]) -> FlagOps:
        if self._ops is None:
            self._ops = CudaStreamMemOps()
        return self._ops

    def drain(self, buffers: SlotBuffers, timeout_s: float | None = None) -> bool:
        stream = self._streams.get(buffers.slots.device.index or 0)
        if stream is None:
            return True
        if timeout_s is None:
            stream.synchronize()
            return True
        deadline = time.monotonic() + timeout_s
        while not stream.query():  # polling: a stream stalled on a flag must not hang the caller
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


def make_transport(device: str, device_index: int = 0) -> SlotTransport:
    """The transport for ``runtime.device`` ("cpu" or "cuda")."""
    if device == "cpu":
        return CpuSharedMemoryTransport()
    if device == "cuda":
        return CudaIpcTransport(device_index)
    raise VExpertInputError("runtime.device", f"unknown device {device!r}", "use cpu or cuda")
