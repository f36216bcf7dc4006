"""One simulation, predicted throughput at several HBM sizes (the KV cache → batch model).

    python benchmarks/sim_hbm.py out/ds3_jitter.npz > benchmarks/results/issue14/hbm.json
"""

from __future__ import annotations

import json
import sys

from vexpert_runtime.policy.perf_model import InferenceConstants
from vexpert_runtime.policy.profile import PerformanceProfile
from vexpert_runtime.simulation.simulate import SimulationConfig, simulate, summarize
from vexpert_runtime.simulation.trace import load_trace

trace = load_trace(sys.argv[1])
cfg = SimulationConfig(num_gpus=64, num_nodes=8, warmup=50, eplb_policy="global", policies=("static", "vexpert"),
                       eplb_sweep=(50, 100, 500))
results = simulate(trace.counts, cfg)
consts = InferenceConstants(tokens_per_gpu=256, top_k=8, experts_per_gpu=4)
out = {}
for hbm in (80.0, 141.0, 0.0):
    profile = PerformanceProfile()
    profile = profile.with_hardware(profile.hardware.model_copy(update={"hbm_gb": hbm}))
    out[str(hbm)] = summarize(results, profile, consts, 256, 64)
print(json.dumps(out, indent=1))
