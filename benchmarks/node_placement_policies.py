"""Balance of each placement policy of the registry on a live CPU node (issue #23).

One local CPU node (``--workers`` EP ranks) runs the tiny DeepSeek-shaped checkpoint under the bundled
skewed decode load for ``--iterations`` iterations, once per policy (``vexpert.placement_policy``:
static, eplb-redundant, vexpert), outputs verified against the single-process reference. Printed per
policy: the static placement's balance and the balance measured under the policy's plans (means over
the iterations from the first plan on), the maximum relative output error and the allocations::

    .venv/bin/python benchmarks/node_placement_policies.py --workers 4 --iterations 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from runtime_support import TINY_DEEPSEEK_SPEC
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.node import NodeOptions, resolve_setup, run_node
from vexpert_runtime.policy.names import PLACEMENT_POLICY_NAMES
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload


def run(checkpoint: Path, policy: str, workers: int, iterations: int, k: int) -> dict[str, object]:
    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": workers, "gpus_per_node": workers, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95, "placement_policy": policy},
        "tuning": {"allocation_interval": k},
        "runtime": {"device": "cpu", "cpu_workers": workers, "metrics_port": 0},
    })
    setup = resolve_setup(config, checkpoint)
    workload = drifting_workload((("decode_in1000out1000", 1000),), 2, 8, tokens_per_worker=16)
    report = run_node(setup, NodeOptions(workload=workload, iterations=iterations, verify=True))
    planned = [r for r in report.records if r.iteration >= k and r.vexpert_balance is not None]
    return {"policy": policy, "workers": workers, "iterations": iterations, "dispatch": setup.dispatch,
            "static_balance": round(sum(r.static_balance or 0.0 for r in planned) / len(planned), 3),
            "balance": round(sum(r.vexpert_balance for r in planned) / len(planned), 3),
            "max_rel_error": report.max_rel_error, "allocations": report.allocations}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "ckpt", TINY_DEEPSEEK_SPEC, seed=2)
        for policy in PLACEMENT_POLICY_NAMES:
            print(json.dumps(run(checkpoint, policy, args.workers, args.iterations, args.k)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
