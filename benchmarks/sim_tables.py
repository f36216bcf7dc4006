"""Markdown tables for benchmarks/README.md §1 from `vexpert simulate --json` outputs.

    python benchmarks/sim_tables.py benchmarks/results/issue14/main.json [more.json ...]
"""

from __future__ import annotations

import json
import sys


def rows(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    out = [f"<!-- {path}: {doc['trace']['iterations']} iterations, warm-up {doc['config'].get('warmup', 0)}, "
           f"HBM {doc['config'].get('hbm_gb')} GB -->",
           "| policy | balance | p10 | worst layer | vExp/GPU/iter | stalls | dispatch | resident experts GB/GPU "
           "| batch/GPU | tokens/s/GPU | vs static |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in doc["policies"].items():
        tps = s["predicted_tokens_per_s_per_gpu"]
        rel = s["predicted_relative_throughput"]
        out.append(
            f"| {name} | {s['balance_mean']:.3f} | {s['balance_p10']:.3f} | {s['worst_layer_balance']:.3f} ({s['worst_layer']}) "
            f"| {s['vexperts_per_gpu_per_iteration']:.1f} | {s['rebalance_stalls']} | {s['dispatch']} "
            f"| {s['resident_expert_gb_per_gpu']:.2f} | {s['batch_per_gpu']:.0f} "
            f"| {'—' if tps is None else f'{tps:.0f}'} | {'(bound)' if rel is None else f'{rel:.3f}×'} |"
        )
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print("\n".join(rows(arg)) + "\n")
