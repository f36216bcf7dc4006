"""One simulation, predicted throughput at several HBM sizes (the KV cache → batch model).

    python benchmarks/sim_hbm.py out/ds3_jitter.npz > benchmarks/results/issue14/hbm.json
    python benchmarks/sim_hbm.py out/ds3_jitter.npz --weights fp8 > benchmarks/results/issue14/hbm_fp8.json

``--weights bf16`` (default): the paper's DeepSeek-V3 in bf16 (an 88 MB expert; 54.6 GB of weights per GPU at
EP64). ``--weights fp8``: DeepSeek-V3's block-FP8 release as ``vexpert serve --linear-format fp8_block`` keeps it —
a 44 MB expert row (what a slot fill and EPLB's redundant copy move and hold), and the rank's other weights as
``benchmarks/nonexpert_bytes.py`` counts them with FP8 linears. The simulation runs with those constants (vExpert's
allocator weighs each copy's H2D time by its bytes); the time model's a2a / MoE / other times stay the paper's.
"""

from __future__ import annotations

import argparse
import json

from nonexpert_bytes import rank_bytes

from vexpert_runtime.model.expert_layout import Fp8RowLayout
from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.profile import PerformanceProfile
from vexpert_runtime.simulation.simulate import SimulationConfig, simulate, summarize
from vexpert_runtime.simulation.trace import load_trace

MOE_LAYERS, EXPERTS_PER_GPU = 58, 4  # DeepSeek-V3 at EP64


def constants(weights: str) -> InferenceConstants:
    """The time model's constants for DeepSeek-V3 in ``weights`` (bf16: the defaults)."""
    if weights == "bf16":
        return InferenceConstants(tokens_per_gpu=256, top_k=8, experts_per_gpu=EXPERTS_PER_GPU)
    expert = Fp8RowLayout(2048, 7168).row_bytes
    others = rank_bytes()["per_rank_bytes_linear_format_fp8_block"]
    return InferenceConstants(tokens_per_gpu=256, top_k=8, experts_per_gpu=EXPERTS_PER_GPU, expert_bytes=expert,
                              weight_bytes_per_gpu=float(EXPERTS_PER_GPU * MOE_LAYERS * expert + others))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    cfg = SimulationConfig(num_gpus=64, num_nodes=8, warmup=50, eplb_policy="global", policies=("static", "vexpert"),
                           eplb_sweep=(50, 100, 500))
    consts = constants(args.weights)
    out: dict[str, object] = {"weights": args.weights, "expert_bytes": consts.expert_bytes,
                              "weight_bytes_per_gpu": consts.weight_bytes_per_gpu}
    results = simulate(trace.counts, cfg, consts=consts)
    for hbm in (80.0, 141.0, 0.0):
        profile = PerformanceProfile()
        profile = profile.with_hardware(profile.hardware.model_copy(update={"hbm_gb": hbm}))
        out[str(hbm)] = summarize(results, profile, consts, 256, 64)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
