"""Slot handshake without CPU round trips: two int32 flags per MoE layer, next to a worker's slots.

The coordinator (producer) and a worker (consumer) hand each layer's slots back and forth::

    producer, per fill:  wait FREE == 1 · FREE ← 0 · copy experts in · FULL ← 1
    consumer, per layer: wait FULL == 1 · FULL ← 0 · compute with the slot · FREE ← 1

On the GPU every step is a stream operation: the waits and writes are ``cuStreamWaitValue32`` /
``cuStreamWriteValue32`` on the flags, which live in the *worker's* HBM and reach the coordinator
through CUDA IPC together with the slots. Neither CPU blocks: the producer's copy stream stalls on
the GPU until the worker has released the buffer, the worker's compute stream stalls until the copy
landed. Because every wait compares with a constant (1) and every write stores a constant, the
worker's side can be captured once in a CUDA graph and replayed every iteration.

The CPU twin (:class:`CpuFlagOps`) runs the same protocol on a shared-memory tensor with polling
waits, so the protocol is tested in CI; its waits time out (:class:`FlagTimeout`) instead of hanging.

Shapes: ``flags`` is ``[L, 2]`` int32 — one row per MoE layer (:class:`~vexpert_runtime.node.slots.SlotBuffers`),
columns :data:`FREE`, :data:`FULL`. :func:`produce`, :func:`acquire` and :func:`release` are the
handshake's one definition; :mod:`vexpert_runtime.node.protocol` runs them per layer.
"""

from __future__ import annotations

import ctypes
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

FREE, FULL = 0, 1

# CUstreamWaitValue_flags / CUstreamWriteValue_flags (cuda.h)
_WAIT_VALUE_EQ = 0x1
_WRITE_VALUE_DEFAULT = 0x0


class FlagTimeout(TimeoutError):
    """A CPU-twin wait gave up (the other side is gone or late)."""


class FlagWaitInterrupted(RuntimeError):
    """A CPU-twin wait was interrupted by its ``interrupted()`` check (shutdown, the other side died)."""


class FlagOps(ABC):
    """Wait on / write one flag, ordered on ``stream`` (None: the current stream; ignored by the CPU
    twin)."""

    @abstractmethod
    def wait_eq(self, stream: Any, flags: torch.Tensor, buffer: int, which: int, value: int) -> None: ...

    @abstractmethod
    def write(self, stream: Any, flags: torch.Tensor, buffer: int, which: int, value: int) -> None: ...


class CpuFlagOps(FlagOps):
    """CPU twin: flags in shared memory, waits poll (x86 stores are seen in order, and the copy
    before ``FULL ← 1`` is a plain memcpy in the same thread). A wait gives up with
    :class:`FlagTimeout` after ``timeout_s`` (None: never) or :class:`FlagWaitInterrupted` once
    ``interrupted()`` is true; polls back off from ``poll_s`` to 1 ms so idle waiters leave the CPU
    to the side they wait for."""

    def __init__(self, timeout_s: float | None = 10.0, poll_s: float = 5e-5,
                 interrupted: Callable[[], bool] | None = None) -> None:
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.interrupted = interrupted
        self._arrays: dict[tuple[int, tuple[int, ...], tuple[int, ...]], np.ndarray] = {}

    def _array(self, flags: torch.Tensor) -> np.ndarray:
        """A numpy view of ``flags`` (the same shared memory), made once per tensor: indexing the
        tensor costs ~4 µs a read or write, the array's element ~0.1 µs, and the coordinator's fill
        loop reads and writes flags a few times per layer and worker every iteration. The view keeps
        the tensor's storage alive, so a key (address, shape, strides) is never reused by another."""
        key = (flags.data_ptr(), tuple(flags.shape), tuple(flags.stride()))
        array = self._arrays.get(key)
        if array is None:
            array = self._arrays[key] = flags.numpy()
        return array

    def wait_eq(self, stream: Any, flags: torch.Tensor, buffer: int, which: int, value: int) -> None:
        array = self._array(flags)
        if array[buffer, which] == value:
            return
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        pause = self.poll_s
        while array[buffer, which] != value:
            if deadline is not None and time.monotonic() > deadline:
                name = "FREE" if which == FREE else "FULL"
                raise FlagTimeout(f"buffer {buffer}: {name} did not become {value} within {self.timeout_s} s")
            if self.interrupted is not None and self.interrupted():
                raise FlagWaitInterrupted(f"wait on flag ({buffer}, {which}) == {value} interrupted")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def write(self, stream: Any, flags: torch.Tensor, buffer: int, which: int, value: int) -> None:
        self._array(flags)[buffer, which] = value


class CudaStreamMemOps(FlagOps):
    """GPU path: stream memory operations from the CUDA driver (through ctypes: two symbols, no
    extra dependency). ``flags`` may be this process's tensor or one opened from another process
    through CUDA IPC; the address is what this process sees."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = _symbol(lib, "cuStreamWaitValue32")
        self._write = _symbol(lib, "cuStreamWriteValue32")
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self._error_name(result, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({result})")

    def wait_eq(self, stream: Any, flags: torch.Tensor, buffer: int, which: int, value: int) -> None:
        self._check(self._wait(_stream_handle(stream), flag_address(flags, buffer, which), value, _WAIT_VALUE_EQ),
                    "cuStreamWaitValue32")

    def write(self, stream: Any, flags: torch.Tensor, buffer: int, which: int, value: int) -> None:
        self._check(self._write(_stream_handle(stream), flag_address(flags, buffer, which), value, _WRITE_VALUE_DEFAULT),
                    "cuStreamWriteValue32")


def flag_address(flags: torch.Tensor, buffer: int, which: int) -> int:
    """The address of ``flags[buffer, which]`` (any strides), computed: indexing the tensor makes a view
    object per call (~4 µs), and the coordinator's fill thread enqueues a few flag operations per
    layer per iteration — ~200 an iteration at DeepSeek-V3's 58 layers."""
    return flags.data_ptr() + (buffer * flags.stride(0) + which * flags.stride(1)) * flags.element_size()


def _symbol(lib: ctypes.CDLL, name: str) -> Any:
    # CUDA ≥ 11.7 headers map these names to the _v2 entry points; older drivers have only v1.
    for candidate in (name + "_v2", name):
        try:
            fn = getattr(lib, candidate)
        except AttributeError:
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    raise RuntimeError(f"libcuda has no {name}")


def _stream_handle(stream: Any) -> int:
    # None: the current stream (under graph capture, the capturing stream).
    return int((stream if stream is not None else torch.cuda.current_stream()).cuda_stream)


# ------------------------------------------------------------------------------------------------
# The protocol (one definition for both sides and both backends)
# ------------------------------------------------------------------------------------------------


def produce(ops: FlagOps, stream: Any, flags: torch.Tensor, buffer: int, copy_in: Any) -> None:
    """Producer side of one fill: wait until ``buffer`` is free, claim it, ``copy_in()``, mark it full.

    ``copy_in`` enqueues the copies on ``stream`` (GPU) or performs them (CPU).
    """
    ops.wait_eq(stream, flags, buffer, FREE, 1)
    ops.write(stream, flags, buffer, FREE, 0)
    try:
        copy_in()
    except BaseException:
        # hand the buffer back (still not FULL): a failed fill must not lock it for good
        ops.write(stream, flags, buffer, FREE, 1)
        raise
    ops.write(stream, flags, buffer, FULL, 1)


def acquire(ops: FlagOps, stream: Any, flags: torch.Tensor, buffer: int) -> None:
    """Consumer: wait until ``buffer`` is full, then consume the FULL mark."""
    ops.wait_eq(stream, flags, buffer, FULL, 1)
    ops.write(stream, flags, buffer, FULL, 0)


def release(ops: FlagOps, stream: Any, flags: torch.Tensor, buffer: int) -> None:
    """Consumer: the layer that read ``buffer`` is done with it."""
    ops.write(stream, flags, buffer, FREE, 1)
