"""Our EPLB (`vexpert_runtime.policy.eplb`) vs a straight port of DeepSeek's loops (the reference port in
tests/test_eplb.py), on DeepSeek-V3 shape: 58 layers × 256 experts, 8 groups, 8 nodes × 8 GPUs.

    python benchmarks/eplb_speed.py

Prints one JSON line per (policy, replicas): median ms of each and whether the plans are identical.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_eplb import ref_rebalance
from vexpert_runtime.policy.bench import benchmark_counts
from vexpert_runtime.policy.eplb import rebalance_experts


def median_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    weight = benchmark_counts(58, 256, 64)
    for policy in ("hierarchical", "global"):
        for replicas in (256, 320):
            ours = rebalance_experts(weight, replicas, 8, 8, 64, policy)
            ref = ref_rebalance(weight, replicas, 8, 8, 64, policy)
            same = all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
            print(json.dumps({
                "policy": policy, "replicas": replicas, "same_plan": same,
                "ours_ms": round(median_ms(lambda r=replicas, p=policy: rebalance_experts(weight, r, 8, 8, 64, p), 50), 2),
                "reference_ms": round(median_ms(lambda r=replicas, p=policy: ref_rebalance(weight, r, 8, 8, 64, p), 3), 1),
            }))


if __name__ == "__main__":
    main()
