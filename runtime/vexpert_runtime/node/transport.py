"""Slot transport: how the coordinator reaches the workers' L1 slot buffers.

The protocol (:mod:`vexpert_runtime.node.protocol`) only needs five operations, so the device path is
one small class:

* worker side: :meth:`SlotTransport.allocate_slots` makes the slot buffer ``[S, 3·I·H]`` and
  :meth:`SlotTransport.export` turns it into something that crosses a ``torch.multiprocessing``
  queue;
* coordinator side: :meth:`SlotTransport.open` maps a worker's buffer, :meth:`SlotTransport.host_buffer`
  allocates L2 pool memory, :meth:`SlotTransport.copy` enqueues one expert copy and
  :meth:`SlotTransport.flush` makes every enqueued copy into one worker's buffer complete before the
  ready signal.

:class:`CpuSharedMemoryTransport` is the CPU twin: slots are shared-memory tensors (torch's
``file_descriptor`` strategy: the /dev/shm file is unlinked at creation, so nothing can leak), a copy
is ``copy_`` and the ready signal's lock provides the memory fence. :class:`CudaIpcTransport` is the
GPU path: slots in the worker's HBM shared through CUDA IPC, pinned host pool, asynchronous copies on
one copy stream per GPU, and :meth:`~CudaIpcTransport.flush` synchronizes that stream, so the
coordinator never signals "filled" before the copies landed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from vexpert_runtime.errors import VExpertInputError


class SlotTransport(ABC):
    """Moves packed expert rows from the coordinator's L2 pool into workers' L1 slots."""

    kind: str = ""

    @abstractmethod
    def allocate_slots(self, slots: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Worker: a zeroed slot buffer [S, numel] the coordinator can write."""

    def export(self, buffers: torch.Tensor) -> Any:
        """Worker: a handle for the coordinator (sent through a torch.multiprocessing queue)."""
        return buffers

    def open(self, handle: Any) -> torch.Tensor:
        """Coordinator: the worker's buffer [S, numel] from its handle."""
        tensor: torch.Tensor = handle
        return tensor

    @abstractmethod
    def host_buffer(self, rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Coordinator: L2 pool memory [rows, numel] (pinned where it speeds up copies)."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Coordinator: enqueue dst ← src for one expert row."""

    @abstractmethod
    def flush(self, dst: torch.Tensor) -> None:
        """Coordinator: block until every copy enqueued into ``dst`` (a worker's buffer) has landed."""


class CpuSharedMemoryTransport(SlotTransport):
    """CPU twin: slots are shared-memory tensors, copies are synchronous memcpy."""

    kind = "cpu-shm"

    def allocate_slots(self, slots: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(slots, numel, dtype=dtype).share_memory_()

    def host_buffer(self, rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(rows, numel, dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def flush(self, dst: torch.Tensor) -> None:
        return None


@dataclass(frozen=True)
class CudaSlotHandle:
    """A worker's slot buffers as ``torch.multiprocessing``'s CUDA IPC reduction (plain data)."""

    args: tuple[Any, ...]


class CudaIpcTransport(SlotTransport):
    """GPU path: slots live in each worker's HBM and reach the coordinator through CUDA IPC
    (torch.multiprocessing shares CUDA tensors that way); the pool is pinned host memory and each
    worker's copies go on their own stream. Only constructed where CUDA exists."""

    kind = "cuda-ipc"

    def __init__(self, device_index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise VExpertInputError(
                "runtime.device",
                "cuda was requested but no CUDA device is visible",
                "set runtime.device: cpu (or pass --cpu-workers N), or run on a GPU node",
            )
        self.device = torch.device("cuda", device_index)
        self._streams: dict[int, torch.cuda.Stream] = {}

    def export(self, buffers: torch.Tensor) -> Any:
        """The CUDA IPC handle as plain data: the node passes it on to every coordinator process it
        starts without opening it (a tensor received over IPC cannot be sent on, and the node needs
        no CUDA context)."""
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(buffers)
        return CudaSlotHandle(tuple(args))

    def open(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        tensor: torch.Tensor = rebuild_cuda_tensor(*handle.args)
        return tensor

    def allocate_slots(self, slots: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffers = torch.zeros(slots, numel, dtype=dtype, device=self.device)
        # The zero fill runs on this process's stream; the coordinator's copies (another process,
        # another stream) must not race it.
        torch.cuda.synchronize(self.device)
        return buffers

    def host_buffer(self, rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(rows, numel, dtype=dtype, pin_memory=True)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index or 0
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=device)
        return self._streams[index]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(dst.device)):
            dst.copy_(src, non_blocking=True)

    def flush(self, dst: torch.Tensor) -> None:
        stream = self._streams.get(dst.device.index or 0)
        if stream is not None:
            stream.synchronize()


def make_transport(device: str, device_index: int = 0) -> SlotTransport:
    """The transport for ``runtime.device`` ("cpu" or "cuda")."""
    if device == "cpu":
        return CpuSharedMemoryTransport()
    if device == "cuda":
        return CudaIpcTransport(device_index)
    raise VExpertInputError("runtime.device", f"unknown device {device!r}", "use cpu or cuda")
