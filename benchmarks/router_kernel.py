"""A router per layer on one GPU: transformers' router (eager, and compiled by inductor as ``vexpert serve
--compile`` ran it before) against the product's stand-in (``serve/fused_router.py``: DeepSeek-V3's logits as
a tensor-core GEMM with fp32 output, then one selection kernel; Qwen's softmax top-k in one kernel after
its bf16 GEMM), each in a CUDA graph of 20 calls (as the decode step replays it), bf16 hidden states.

Shapes: DeepSeek-V3's release routing (H 7168, 256 experts in 8 groups, 4 kept, top-8), 8 experts in 4 groups
(2 kept, top-2), the benchmark checkpoint's (8 experts top-2, no groups), Qwen3-30B-A3B's (H 2048, softmax
top-8 of 128), at
16 / 64 / 256 tokens. Also printed: how many tokens' expert sets differ from transformers' (near ties under
a different summation order; bf16 logits that tie exactly, where either expert is a top-k).

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

from vexpert_runtime.serve.fused_router import stand_in_for

CALLS = 20
# label: (family, hidden, experts, groups, groups kept, top-k)
ROUTINGS = {"deepseek_v3 256 experts": ("deepseek_v3", 7168, 256, 8, 4, 8),
            "deepseek_v3 8 experts": ("deepseek_v3", 7168, 8, 4, 2, 2),
            "deepseek_v3 8 experts, no groups": ("deepseek_v3", 7168, 8, 1, 1, 2),
            "qwen3_moe 128 experts": ("qwen3_moe", 2048, 128, 1, 1, 8)}


def make_router(family: str, hidden: int, experts: int, groups: int, kept: int, top_k: int) -> Any:
    """transformers' router of ``family`` in bf16 on the GPU, random weights (and correction bias)."""
    import transformers

    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        router: Any = DeepseekV3TopkRouter(transformers.DeepseekV3Config(
            n_routed_experts=experts, n_group=groups, topk_group=kept, num_experts_per_tok=top_k, hidden_size=hidden,
            routed_scaling_factor=2.5)).to("cuda", torch.bfloat16)
        router.e_score_correction_bias.normal_(0, 0.01)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(
            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, hidden_size=hidden)).to(
            "cuda", torch.bfloat16)
    torch.nn.init.normal_(router.weight, std=0.02)
    return router


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
    rows = []
    for label, (family, hidden, experts, groups, kept, top_k) in ROUTINGS.items():
        torch.manual_seed(experts)
        router = make_router(family, hidden, experts, groups, kept, top_k)
        fused = stand_in_for(router)
        assert fused is not None, label
        compiled = torch.compile(router, dynamic=None)
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
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
