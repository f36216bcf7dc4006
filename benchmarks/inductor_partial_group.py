"""Count the wrong elements inductor's compiled code gives where a per-group scale is spread over the columns of
a row whose last group is partial (why ``fp8_activations.per_column`` indexes instead).

Each form divides x [5, cols] by 2 group scales of 128 columns spread to cols columns; eager and
``torch.compile`` (fresh, static shapes) are compared element for element:

    PYTHONPATH=runtime python benchmarks/inductor_partial_group.py

torch 2.13 CPU (this repository's CI machine): ``repeat_interleave(...)[:, :cols]`` and an expand-reshape-slice
give wrong elements for every cols in (128, 256) but none at 128 or 256; the index form none anywhere.
"""

from __future__ import annotations

import json

import torch

from vexpert_runtime.model.fp8_activations import per_column


def _forms(cols: int) -> dict:
    def repeat_slice(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x / s.repeat_interleave(128, dim=1)[:, :cols]

    def expand_slice(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x / s[:, :, None].expand(s.shape[0], s.shape[1], 128).reshape(s.shape[0], -1)[:, :cols]

    def index(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x / per_column(s, 128, cols)

    return {"repeat_interleave_slice": repeat_slice, "expand_reshape_slice": expand_slice, "index": index}


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    for cols in (128, 136, 200, 248, 256):
        x = torch.randn(5, cols, generator=generator)
        scales = torch.rand(5, 2, generator=generator) + 0.5
        wrong = {}
        for name, fn in _forms(cols).items():
            torch._dynamo.reset()
            wrong[name] = int((fn(x, scales) != torch.compile(fn)(x, scales)).sum())
        print(json.dumps({"torch": torch.__version__, "cols": cols, "elements": x.numel(), "wrong": wrong}))


if __name__ == "__main__":
    main()
