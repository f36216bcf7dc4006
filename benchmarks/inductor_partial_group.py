"""Count the cases where inductor's compiled per-token-group FP8 quantisation differs from eager (why
``fp8_activations.quantize_activation_groups`` takes a partial last group group by group).

Each form quantises x [rows, cols] per row and 128 columns (scale = amax / 448) and dequantises it again in the
same function (a consumer fused with the quantisation, as the dispatch's wire rows and the CPU twin have it);
eager and ``torch.compile`` (fresh, static shapes) are compared bit for bit:

    PYTHONPATH=runtime python benchmarks/inductor_partial_group.py

torch 2.13 CPU (this repository's CI machine): the padded-tile form, the scales spread by ``repeat_interleave(...)
[:, :cols]`` and by an index computed in the graph (``arange(cols) // 128``) each give wrong elements for some
widths with a partial last group (the indexed form at 1 row only), none at whole groups; the product's form
(tiles for whole groups, one slice per group otherwise) none.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from vexpert_runtime.model.fp8_activations import FP8_DTYPE, FP8_MAX, fp8_activation_round_trip

GROUP = 128


def _scales(x: torch.Tensor) -> torch.Tensor:
    groups = -(-x.shape[1] // GROUP)
    padded = torch.nn.functional.pad(x.abs(), (0, groups * GROUP - x.shape[1]))
    return padded.view(x.shape[0], groups, GROUP).amax(dim=2).clamp(min=1e-12) / FP8_MAX


def padded_tiles(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    groups = -(-cols // GROUP)
    tiles = torch.nn.functional.pad(x, (0, groups * GROUP - cols)).view(rows, groups, GROUP)
    scale = _scales(x)
    quantised = (tiles / scale[:, :, None]).to(FP8_DTYPE).view(rows, groups * GROUP)[:, :cols]
    return quantised.to(torch.float32) * scale.repeat_interleave(GROUP, dim=1)[:, :cols]


def repeat_interleave(x: torch.Tensor) -> torch.Tensor:
    spread = _scales(x).repeat_interleave(GROUP, dim=1)[:, : x.shape[1]]
    return (x / spread).to(FP8_DTYPE).to(torch.float32) * spread


def indexed(x: torch.Tensor) -> torch.Tensor:
    spread = _scales(x)[:, torch.arange(x.shape[1]) // GROUP]
    return (x / spread).to(FP8_DTYPE).to(torch.float32) * spread


def product(x: torch.Tensor) -> torch.Tensor:
    return fp8_activation_round_trip(x, GROUP)


FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "padded_tiles": padded_tiles, "repeat_interleave": repeat_interleave, "indexed": indexed, "product": product}


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    for cols in (128, 136, 200, 248, 256):
        for rows in (1, 2, 5):
            x = torch.randn(rows, cols, generator=generator) * 3
            wrong = {}
            for name, form in FORMS.items():
                torch._dynamo.reset()
                eager, compiled = form(x), torch.compile(form)(x)
                wrong[name] = int((eager != compiled).sum())  # NaN counts as wrong
            print(json.dumps({"torch": torch.__version__, "cols": cols, "rows": rows, "elements": x.numel(),
                              "wrong": wrong}))


if __name__ == "__main__":
    main()
