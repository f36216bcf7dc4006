"""Why W8A8's activations are quantised ahead of the grouped GEMM, not inside it: Triton's interpreter (the CPU
tests' twin of every kernel) narrows float32 to e4m3 wrongly where rounding carries into the exponent, so an
in-kernel quantisation could not be checked on CPU against torch's.

Casts uniform random values in ±448 (and a few chosen ones) to ``tl.float8e4nv`` in an interpreted kernel and
counts those that differ from ``torch``'s ``.to(torch.float8_e4m3fn)``; prints JSON with the first few.

    TRITON_INTERPRET=1 PYTHONPATH=runtime python benchmarks/triton_interpreter_fp8_cast.py
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _narrow(x, y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, tl.load(x + i).to(tl.float8e4nv))


def main() -> None:
    n = 1 << 16
    x = (torch.rand(n, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 448
    x[:4] = torch.tensor([126.4, 124.5, 0.0019, -126.4])
    y = torch.empty(n, dtype=torch.float8_e4m3fn)
    _narrow[(1,)](x, y, N=n)
    want = x.to(torch.float8_e4m3fn).float()
    bad = (y.float() != want).nonzero().flatten()
    print(json.dumps({"triton": triton.__version__, "interpreted": os.environ.get("TRITON_INTERPRET") == "1",
                      "values": n, "mismatches": len(bad),
                      "first": [(round(x[i].item(), 4), want[i].item(), y[i].float().item()) for i in bad[:5].tolist()]}))


if __name__ == "__main__":
    main()
