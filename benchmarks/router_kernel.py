"""DeepSeek-V3's router per layer on one GPU: transformers' ``DeepseekV3TopkRouter`` (eager, and compiled by
inductor as ``vexpert serve --compile`` ran it before) against the product's ``FusedDeepseekV3Router``
(``serve/fused_router.py``: a tensor-core logits GEMM with fp32 output + one selection kernel), each in a
CUDA graph of 20 calls (as the decode step replays it), bf16 hidden states at H 7168.

Shapes: the release's routing (256 experts in 8 groups, 4 kept, top-8) and the benchmark checkpoint's
(8 experts in 4 groups, 2 kept, top-2), at 16 / 64 / 256 tokens. Also printed: how many tokens' expert
sets differ from transformers' (near ties under a different summation order).

    python benchmarks/router_kernel.py --out benchmarks/results/serve_engine/router_kernel_runNN.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.serve.fused_router import FusedDeepseekV3Router

CALLS = 20
ROUTINGS = {"256 experts": (256, 8, 4, 8), "8 experts": (8, 4, 2, 2)}


def graph_ms(fn: Any, x: torch.Tensor, repeats: int = 50) -> float:
    """Milliseconds per call of ``fn(x)`` replayed from a CUDA graph of :data:`CALLS` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)  # warm-up: compiles, autotunes, allocates
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(CALLS):
                fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (repeats * CALLS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    rows = []
    for label, (experts, groups, kept, top_k) in ROUTINGS.items():
        torch.manual_seed(experts)
        config = transformers.DeepseekV3Config(n_routed_experts=experts, n_group=groups, topk_group=kept,
                                               num_experts_per_tok=top_k, hidden_size=7168, routed_scaling_factor=2.5)
        router = DeepseekV3TopkRouter(config).to("cuda", torch.bfloat16)
        torch.nn.init.normal_(router.weight, std=0.02)
        router.e_score_correction_bias.normal_(0, 0.01)
        fused = FusedDeepseekV3Router(router)
        compiled = torch.compile(router, dynamic=None)
        for tokens in args.tokens:
            x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
            with torch.inference_mode():
                differ = int((fused(x)[2].sort(1).values != router(x)[2].sort(1).values).any(1).sum())
                row = {"routing": label, "tokens": tokens, "transformers_ms": round(graph_ms(router, x), 4),
                       "transformers_compiled_ms": round(graph_ms(compiled, x), 4),
                       "fused_ms": round(graph_ms(fused, x), 4), "tokens_whose_experts_differ": differ}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
