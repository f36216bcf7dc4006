"""A node runs any placement policy of the registry, chosen in its runtime config: EPLB's redundant
experts as a live baseline beside vExpert, on the same skewed load, outputs verified."""

from __future__ import annotations

from pathlib import Path

from runtime_support import TINY_DEEPSEEK_SPEC
from vexpert_runtime.config import RuntimeConfig
from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
from vexpert_runtime.node import NodeOptions, NodeReport, resolve_setup, run_node
from vexpert_runtime.policy.allocator import AllocatorConfig
from vexpert_runtime.policy.eplb import redundant_per_gpu
from vexpert_runtime.ports import free_port
from vexpert_runtime.simulation.workload import drifting_workload

K = 4  # iterations per allocation window
WORKERS = 2


def _run(checkpoint: Path, policy: str) -> tuple[str, NodeReport]:
    """24 iterations of a skewed decode load on two CPU workers; returns the resolved dispatch and the report."""
    config = RuntimeConfig.model_validate({
        "model": {"checkpoint_path": str(checkpoint), "dtype": "float32"},
        "parallelism": {"expert_parallel_size": WORKERS, "gpus_per_node": WORKERS, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95, "placement_policy": policy},
        "tuning": {"allocation_interval": K},
        "runtime": {"device": "cpu", "cpu_workers": WORKERS, "metrics_port": 0},
    })
    setup = resolve_setup(config, checkpoint)
    assert setup.placement_policy == policy
    workload = drifting_workload((("decode_in1000out1000", 1000),), 2, 8, tokens_per_worker=16)
    return setup.dispatch, run_node(setup, NodeOptions(workload=workload, iterations=24, verify=True))


def _planned_balance(report: NodeReport) -> tuple[float, float]:
    """Mean balance of the static placement and as measured, over the iterations served by a plan
    (from the second window on: the first one runs the static table)."""
    records = [r for r in report.records if r.iteration >= K and r.vexpert_balance is not None]
    assert records
    return (sum(r.static_balance or 0.0 for r in records) / len(records),
            sum(r.vexpert_balance for r in records) / len(records))


def test_node_runs_eplb_from_the_registry_beside_vexpert(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", TINY_DEEPSEEK_SPEC, seed=2)
    dispatch: dict[str, str] = {}
    balance: dict[str, float] = {}
    static: dict[str, float] = {}  # the static placement's balance on each run's own counts
    for policy in ("eplb-redundant", "vexpert"):
        dispatch[policy], report = _run(checkpoint, policy)
        assert report.iterations == 24 and report.allocations >= 4
        assert report.max_rel_error is not None and report.max_rel_error < 1e-4  # outputs exact under either plan
        static[policy], balance[policy] = _planned_balance(report)
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
