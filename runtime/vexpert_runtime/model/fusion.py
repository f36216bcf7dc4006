"""Kernel fusion for a captured step: the step's small pure pieces compiled with ``torch.compile``.

A graphed decode step of the serving engine was ~780 kernels for a 3-layer DeepSeek-V3, most of them
tiny (RMSNorm's six, the router's nineteen, sampling's hash, the EP layer's dispatch bookkeeping);
inside a CUDA graph the GPU idles between them. Compiling those pieces with inductor fuses each into
one or a few Triton kernels; the GEMMs stay cuBLAS / CUTLASS calls. That is what vLLM does too
(``torch.compile`` plus its own CUDA graphs), and transformers' modules stay the source of the
arithmetic: a compiled module runs its own ``forward``.

Compiled code is only worth its start-up cost where a step is captured once and replayed many
times, so the serving rank turns it on with its CUDA graphs (``vexpert serve --compile``); the
eager functions stay the CPU path and the reference the compiled ones are tested against.

``dynamic=None`` (dynamo's automatic dynamic shapes): a piece is traced static at its first shape and
once more with the sizes that changed (the token count) symbolic (a batch of 1 is specialised), so a
rank compiles each piece two or three times, not once per bucket, while the hidden size stays a constant. With ``dynamic=True`` every size
was a symbol: the EP layer's row copies did an integer division by the symbolic hidden size per
element (35-39 us for ~7 MB at 256 tokens on an H200), and the graphed decode step at 256 sequences
took 2.446 ms against 2.303 ms now (benchmarks/README.md, §10, run 14). Inductor's on-disk cache
makes a restarted rank's compiles cache hits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., Any])

# Every piece is compiled once per distinct shape class; DeepSeek-V3's 61 layers call the same
# pieces with the same shapes, so the default cache of 8 entries per code object is plenty — but
# a module class compiled for several widths (the hidden, q_lora and kv_lora norms) needs room.
_RECOMPILE_LIMIT = 32


@functools.cache
def compiled(fn: F) -> F:
    """``fn`` compiled by inductor (``dynamic=None``: see the module docstring; lazily, at its first
    call). The same object for the same ``fn``, so every caller shares one compile cache."""
    _configure()
    return torch.compile(fn, dynamic=None)  # type: ignore[return-value]


def maybe_compiled(fn: F, on: bool) -> F:
    """:func:`compiled` ``fn`` where ``on``, else ``fn`` itself (the eager path)."""
    return compiled(fn) if on else fn


def compile_modules(modules: Iterable[nn.Module | None]) -> int:
    """Compile transformers modules in place (``nn.Module.compile``: their own ``forward``, the state
    dict unchanged); returns how many. None entries are skipped."""
    _configure()
    count = 0
    for module in modules:
        if module is not None:
            module.compile(dynamic=None)
            count += 1
    return count


def _configure() -> None:
    import torch._dynamo
    import torch._inductor.config

    config: Any = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
        if hasattr(config, name) and getattr(config, name) < _RECOMPILE_LIMIT:
            setattr(config, name, _RECOMPILE_LIMIT)
    # A symbol per dynamic size: with duck sizing a bucket of 512 tokens would be traced as "the
    # latent width" (kv_lora_rank 512) and every other bucket would recompile.
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    # Round where eager rounds (a bf16 cast inside a fused kernel is kept, not skipped), so compiled
    # pieces compute what transformers' eager modules do, bit for bit as a rule.
    inductor: Any = torch._inductor.config
    if hasattr(inductor, "emulate_precision_casts"):
        inductor.emulate_precision_casts = True
