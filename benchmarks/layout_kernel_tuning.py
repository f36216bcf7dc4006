"""Time the EP layer's layout kernel (``model/layout_kernel.py``) over its launch parameters on a GPU (issue #21).

One program lays a MoE layer's rows out by local expert. In run 31's profile of the graphed 256-sequence step on an
H100 it took 24 µs a layer (512 rows) and 6.6 µs at 64 sequences: it scales with the rows, so it is one block
walking them, not memory. This times ``fused_arrange_local`` (one rank's pairs, as the single-GPU step serves it) and
``fused_arrange_received`` at the step's row counts over warps and chunk sizes (one-hot entries a chunk holds),
each launch captured ``--iters`` times in one CUDA graph (as the step replays it), every result checked equal to the
served launch's; printed per row count: the served launch, the best, and their times.

    PYTHONPATH=runtime python3 benchmarks/layout_kernel_tuning.py --tokens 16 64 256 --out layout_kernel_tuning.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
from grouped_gemm_tuning import graphed_ms, write_results

from vexpert_runtime.model.ep_moe import DeviceRoutingTable, static_table
from vexpert_runtime.model.layout_kernel import fused_arrange_local, fused_arrange_received, launch_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="vExpert slots on the rank (G·vmax)")
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--chunk-entries", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("layout_kernel_tuning.py times a CUDA kernel: no CUDA device here")
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    table = DeviceRoutingTable.of(static_table(2, args.experts, 1, args.slots), device)
    groups = 1 << (args.experts + args.slots).bit_length()  # next power of two above E + S (the padding column)
    rows_out: list[dict[str, object]] = []
    for tokens in args.tokens:
        # skewed routing, as the benchmark checkpoint's: expert e drawn with weight 1/(e+1)
        weights = torch.tensor([1.0 / (e + 1) for e in range(args.experts)])
        ids = torch.stack([torch.multinomial(weights, args.top_k, generator=generator)
                           for _ in range(tokens)]).to(device)
        received = torch.randint(-1, args.experts + args.slots, (tokens * args.top_k,), generator=generator).to(device)
        cases: dict[str, Callable[[tuple[int, int] | None], object]] = {
            "local": lambda config, ids=ids: fused_arrange_local(ids, table.local[1], args.experts, args.slots, 16,
                                                                 config),
            "received": lambda config, rows=received: fused_arrange_received(rows, args.experts, args.slots, 16, config),
        }
        for form, run in cases.items():
            want = run(None)
            served = launch_config(tokens * args.top_k, groups)
            results = []
            for warps, entries in itertools.product(args.warps, args.chunk_entries):
                got = run((warps, entries))
                equal = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # type: ignore[call-overload]
                if not equal:
                    raise AssertionError(f"{form} {tokens} tokens, warps {warps}, chunk {entries}: not equal to served")
                results.append({"warps": warps, "chunk_entries": entries,
                                "us": round(graphed_ms(args.iters, lambda c=(warps, entries), run=run: run(c)) * 1e3, 2)})
            best = min(results, key=lambda r: r["us"])
            served_us = next(r["us"] for r in results if (r["warps"], r["chunk_entries"]) == served)
            row = {"form": form, "tokens": tokens, "rows": tokens * args.top_k, "served": served,
                   "served_us": served_us, "best": best, "all": results}
            rows_out.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
    if args.out:
        write_results(args.out, rows=rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
