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

from runtime_support import TINY_DEEPSEEK_SPEC, planned_balance, run_policy_node
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.policy.names import PLACEMENT_POLICY_NAMES


def run(checkpoint: Path, policy: str, workers: int, iterations: int, k: int) -> dict[str, object]:
    setup, report = run_policy_node(checkpoint, policy, workers, iterations, k)
    static, balance = planned_balance(report, k)
    return {"policy": policy, "workers": workers, "iterations": iterations, "dispatch": setup.dispatch,
            "static_balance": round(static, 3), "balance": round(balance, 3),
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
