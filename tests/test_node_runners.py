"""The node worker's model runners on their own: the synthetic decode a worker chooses when it does
not serve, run in this process as one EP rank on CPU (no coordinator: the rank claims its iterations
and sets its slot flags itself, the static table), equals the single-process reference model and
reports the iteration's expert counts and computed rows; a slot probe sees the slots each layer
computed with."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime_support import TINY_DEEPSEEK_SPEC
from slot_audit import SlotAudit
from vexpert_runtime.model.checkpoint import CheckpointReader, write_tiny_checkpoint
from vexpert_runtime.model.ep_moe import static_table
from vexpert_runtime.model.reference import ModelWeights, reference_forward
from vexpert_runtime.node.gpu_sync import CpuFlagOps
from vexpert_runtime.node.protocol import SharedState, WorkerSlots
from vexpert_runtime.node.runners import (
    DeviceTables,
    IterationStats,
    RunnerContext,
    SyntheticDecodeRunner,
    choose_runner,
)
from vexpert_runtime.node.slot_probe import ProbedSlots
from vexpert_runtime.node.slots import row_checksum
from vexpert_runtime.node.transport import CpuSharedMemoryTransport
from vexpert_runtime.node.worker_args import WorkerArgs
from vexpert_runtime.simulation.workload import drifting_workload

SPEC = TINY_DEEPSEEK_SPEC
SLOTS = 2
CPU = torch.device("cpu")


def _args(checkpoint: Path, shared: SharedState) -> WorkerArgs:
    """One rank of one, no coordinator; a skewed workload (its router bias reaches every layer)."""
    workload = drifting_workload((("decode_in1000out1000", 1000),), SPEC.num_layers, SPEC.num_experts, tokens_per_worker=16)
    return WorkerArgs(local_rank=0, gpu=0, shared_gpu=False, rank=0, world=1, rendezvous="tcp://127.0.0.1:0",
                      checkpoint=str(checkpoint), spec=SPEC, dtype="float32", device="cpu",
                      slots=SLOTS, k=4, timeout_s=5.0, workload=workload, shared=shared, results=None,
                      control=None, parent_pid=0, verify=True)


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """What a CPU worker holds when it starts its runner: the checkpoint, its slots and flags,
    the device tables and the statistics tensor."""
    write_tiny_checkpoint(tmp_path, SPEC)
    shared = SharedState.create(1, SLOTS, multiprocessing.get_context("spawn"))
    shared.detach_coordinator()  # none will attach: the rank runs degraded at once
    buffers = CpuSharedMemoryTransport().allocate(SLOTS, SPEC.expert_numel, torch.float32, layers=SPEC.num_layers)
    stopping = threading.Event()
    slots = WorkerSlots(shared, 0, buffers, 5.0, CpuFlagOps(timeout_s=5.0, interrupted=stopping.is_set))
    buffers.slots.copy_(torch.randn(buffers.slots.shape))  # whatever a coordinator left there
    stats = IterationStats.zeros(SPEC.num_layers, SPEC.num_experts, SPEC.num_experts + SLOTS, CPU)

    def context(worker_slots: WorkerSlots = slots) -> RunnerContext:
        return RunnerContext(spec=SPEC, rank=0, world=1, group=None, device=CPU, dtype=torch.float32,
                             slots=worker_slots, num_slots=SLOTS, rescue=None,
                             tables=DeviceTables.allocate(SPEC, 1, SLOTS, CPU), stats=stats, graph_stream=None,
                             dispatch="plan", stop_requested=lambda iteration: stopping.is_set(),
                             heartbeat=lambda: None)

    yield {"checkpoint": tmp_path, "shared": shared, "slots": slots, "stats": stats, "context": context}
    stopping.set()


@pytest.mark.parametrize("probed", [False, True])
def test_a_worker_that_does_not_serve_runs_the_synthetic_decode(rank: dict[str, Any], probed: bool) -> None:
    args = _args(rank["checkpoint"], rank["shared"])
    reader = CheckpointReader(args.checkpoint, SPEC)
    audit = SlotAudit()
    plain: WorkerSlots = rank["slots"]
    slots = ProbedSlots(audit, rank["shared"], 0, plain.buffers, 5.0, plain.ops) if probed else plain
    runner = choose_runner(args, reader, CPU, torch.float32)(rank["context"](slots))
    assert isinstance(runner, SyntheticDecodeRunner)
    reference = ModelWeights.load(reader)
    stats: IterationStats = rank["stats"]
    table = static_table(SPEC.num_layers, SPEC.num_experts, 1, SLOTS)
    tokens = args.workload.tokens_per_worker
    for iteration in range(3):
        runner.await_work(iteration)  # the workload always has the next iteration
        runner.prepare(iteration)
        header, _ = slots.begin(iteration)
        assert header is None  # no coordinator: the rank sets its FULL flags itself
        stats.all.fill_(-1)  # the runner's statistics replace whatever the tensor held
        output = runner.run(iteration, table, use_plan=False)
        slots.finish(iteration)

        x = args.workload.inputs(iteration, 0, SPEC.hidden_size)
        bias = args.workload.logit_bias(iteration)
        assert bias is not None
        expected, counts = reference_forward(x, reference, bias)
        assert output.hidden is not None
        torch.testing.assert_close(output.hidden, expected, rtol=1e-5, atol=1e-5)
        assert not output.graphed
        assert torch.equal(stats.counts, counts)
        # one rank holds every expert: each routed pair computed once, by its resident copy
        assert stats.computed.sum(1).tolist() == [tokens * SPEC.top_k] * SPEC.num_layers
        assert stats.computed[:, SPEC.num_experts:].sum() == 0  # static table: slots unused
        checksums = [row_checksum(slots.slot(s)) for s in range(SLOTS)]
        seen = audit.iteration_done(stats.computed).slot_checksums  # what each layer computed with
        assert seen == ([checksums] * SPEC.num_layers if probed else [])


def test_a_single_node_group_meets_in_a_file_store_and_a_multi_node_one_over_tcp() -> None:
    """One node: no listening rendezvous socket at all (torch's TCPStore binds every interface);
    each group start gets its own store file. Several nodes: rank 0's address and port."""
    import dataclasses

    from vexpert_runtime.node.setup import LOOPBACK, rendezvous_address, rendezvous_url

    single = dataclasses.make_dataclass("S", ["world", "local_workers", "master_addr", "master_port"])
    one, again = rendezvous_url(single(2, 2, LOOPBACK, 1234)), rendezvous_url(single(2, 2, LOOPBACK, 1234))
    assert one.startswith("file://") and again.startswith("file://") and one != again
    assert not Path(one[len("file://"):]).exists()  # made by the first rank, not before
    assert rendezvous_url(single(4, 2, "10.0.0.7", 29500)) == "tcp://10.0.0.7:29500"
    assert rendezvous_address("0.0.0.0", None, 1)[0] == LOOPBACK
    assert rendezvous_address("10.0.0.7", None, 2) == ("10.0.0.7", 29500)


class _EagerGraph:
    """:class:`~vexpert_runtime.node.step_graph.StepGraph` on CPU: "capture" keeps the closure the runner
    hands over (its iteration, table and device tables frozen, as a CUDA graph's are) and a replay
    calls it again."""

    captures = 0

    def __init__(self, run: Any, stream: Any, inputs: torch.Tensor, bias: torch.Tensor | None) -> None:
        type(self).captures += 1
        self.run, self.inputs, self.bias = run, inputs, bias

    def fits(self, inputs: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return inputs.shape == self.inputs.shape and (bias is None) == (self.bias is None)

    def replay(self, inputs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.run(inputs, bias)


def test_the_opening_static_plan_replays_the_captured_step_and_degraded_iterations_do_not(
        rank: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose allocations are all skipped (one rank, a balanced load) stays on its opening plan,
    the static table: those iterations replay the step captured at iteration 2 (until 2026-12-05 only
    plans other than the first did, so a one-GPU node never replayed a graph); a degraded iteration
    (no agreed plan) runs eagerly. Outputs equal the reference either way."""
    import dataclasses

    import vexpert_runtime.node.runners as runners

    monkeypatch.setattr(runners, "StepGraph", _EagerGraph)
    args = _args(rank["checkpoint"], rank["shared"])
    reader = CheckpointReader(args.checkpoint, SPEC)
    runner = choose_runner(args, reader, CPU, torch.float32)(
        dataclasses.replace(rank["context"](), graph_stream="capture stream"))
    reference = ModelWeights.load(reader)
    slots: WorkerSlots = rank["slots"]
    opening = static_table(SPEC.num_layers, SPEC.num_experts, 1, SLOTS)  # plan id 0
    graphed = []
    for iteration in range(6):
        runner.prepare(iteration)
        slots.begin(iteration)
        agreed = iteration != 4  # iteration 4: degraded
        output = runner.run(iteration, opening, use_plan=agreed)
        slots.finish(iteration)
        graphed.append(output.graphed)
        x = args.workload.inputs(iteration, 0, SPEC.hidden_size)
        expected, _ = reference_forward(x, reference, args.workload.logit_bias(iteration))
        assert output.hidden is not None
        torch.testing.assert_close(output.hidden, expected, rtol=1e-5, atol=1e-5)
    assert graphed == [False, False, True, True, False, True]
    assert _EagerGraph.captures == 1
