"""A node runs any placement policy of the registry, chosen in its runtime config: EPLB's redundant
experts as a live baseline beside vExpert, on the same skewed load, outputs verified."""

from __future__ import annotations

from pathlib import Path

from runtime_support import TINY_DEEPSEEK_SPEC, planned_balance, run_policy_node
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.node import NodeReport
from vexpert_runtime.policy.allocator import AllocatorConfig
from vexpert_runtime.policy.eplb import redundant_per_gpu

K = 4  # iterations per allocation window
WORKERS = 2
ITERATIONS = 40  # nine windows after the first: a plan whose fill a loaded machine delays past its window is skipped


def _run(checkpoint: Path, policy: str) -> tuple[str, NodeReport]:
    """ITERATIONS of a skewed decode load on two CPU workers; returns the resolved dispatch and the report."""
    setup, report = run_policy_node(checkpoint, policy, WORKERS, ITERATIONS, K)
    assert setup.placement_policy == policy
    return setup.dispatch, report


def test_node_runs_eplb_from_the_registry_beside_vexpert(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", TINY_DEEPSEEK_SPEC, seed=2)
    dispatch: dict[str, str] = {}
    balance: dict[str, float] = {}
    static: dict[str, float] = {}  # the static placement's balance on each run's own counts
    for policy in ("eplb-redundant", "vexpert"):
        dispatch[policy], report = _run(checkpoint, policy)
        assert report.iterations == ITERATIONS and report.allocations >= 4
        assert report.max_rel_error is not None and report.max_rel_error < 1e-4  # outputs exact under either plan
        static[policy], balance[policy] = planned_balance(report, K)
        if policy == "eplb-redundant":
            per_layer = redundant_per_gpu(AllocatorConfig(group_size=2, vmax=1))
            planned = [t.slot_expert >= 0 for pid, t in report.tables.items() if pid > 0]  # [L, N, S] each
            # EPLB's V copies per GPU in every layer (a copy whose expert every free GPU already holds stays out)
            assert planned and all((filled.sum(-1) <= per_layer).all() and filled.any(-1).any(-1).all() for filled in planned)
    print(f"node balance over planned iterations: eplb-redundant {balance['eplb-redundant']:.3f} "
          f"(static {static['eplb-redundant']:.3f}, dispatch {dispatch['eplb-redundant']}), "
          f"vexpert {balance['vexpert']:.3f} (static {static['vexpert']:.3f}, dispatch {dispatch['vexpert']})")
    assert dispatch["eplb-redundant"] == "plan"  # auto keeps EPLB's even split
    for policy in ("eplb-redundant", "vexpert"):
        assert balance[policy] > static[policy] + 0.04, policy
