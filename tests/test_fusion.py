"""Kernel fusion (issue #21): the serving step's small pieces compiled by inductor compute what the
eager ones do.

On the CPU inductor emits C++ instead of Triton, but the traced graphs are the ones a GPU rank
compiles: no graph break (each piece is one fused graph), a bounded number of compiles serving every
batch size (``dynamic=None``: the first size static, then the token count symbolic), and the
step's tokens — greedy and seeded sampling, prompt chunks, joins — equal to the eager step's. The GPU twin (compiled + CUDA graphs == eager) is in test_serve_gpu.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
if shutil.which("g++") is None and shutil.which("c++") is None:  # inductor's CPU backend compiles C++
    pytest.skip("inductor on CPU needs a C++ compiler", allow_module_level=True)

from test_serve_model import CHUNK, JOINS, NEW_TOKENS, PROMPTS, _write, drive  # noqa: E402
from vexpert_runtime.model.ep_moe import (  # noqa: E402
    DeviceRoutingTable,
    ExpertStacks,
    arrange_received,
    combine_received,
    ep_moe_layer,
    pack_dispatch,
    static_table,
)
from vexpert_runtime.model.fusion import compiled  # noqa: E402
from vexpert_runtime.serve.hf_model import HFStepModel  # noqa: E402
from vexpert_runtime.serve.moe_executors import EPExperts  # noqa: E402


def test_the_ep_layers_pieces_compiled_equal_the_eager_ones_at_every_batch_size() -> None:
    """pack → arrange → combine, eager and compiled, over batches of 1–96 tokens with slots in the
    table: the same send rows, layout, group ends and outputs; at most three compiles of each piece."""
    import torch._dynamo

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    experts, world, slots, hidden, top_k = 8, 2, 2, 16, 2
    table = DeviceRoutingTable.of(static_table(1, experts, world, slots), "cpu")
    generator = torch.Generator().manual_seed(0)
    for batch in (96, 40, 7, 1):
        x = torch.randn(batch, hidden, generator=generator)
        ids = torch.randint(0, experts, (batch, top_k), generator=generator)
        weights = torch.rand(batch, top_k, generator=generator)
        args = (x, ids, table.gpu[0], table.local[0], table.cum_share[0], 1, world, batch * top_k)
        eager, fused = pack_dispatch(*args), compiled(pack_dispatch)(*args)
        sent = eager[1] >= 0  # rows holding a pair (the others are left unwritten)
        assert torch.equal(eager[0][sent], fused[0][sent])
        assert all(torch.equal(a, b) for a, b in zip(eager[1:], fused[1:], strict=True))
        send_x, send_local, row_of_pair = eager
        layout = arrange_received(send_local, experts // world, slots, 16)
        fused_layout = compiled(arrange_received)(send_local, experts // world, slots, 16)
        assert all(torch.equal(a, b) for a, b in zip(layout, fused_layout, strict=True))
        row_src, position = layout[0], layout[1]
        assert torch.equal(row_src[position], torch.arange(len(position)))  # each row reads what landed there
        back = send_x[row_src].index_select(0, position) * 2.0  # any per-row "expert" will do
        y, dropped = combine_received(back, row_of_pair, weights, None)
        fused_y, fused_dropped = compiled(combine_received)(back, row_of_pair, weights, None)
        torch.testing.assert_close(fused_y, y)
        assert int(dropped) == int(fused_dropped) == 0
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 9  # 3 pieces × (first batch static, batch > 1 symbolic, batch 1)


def test_a_single_ranks_layout_and_combine_compiled_equal_the_eager_ones() -> None:
    """An EP group of one (arrange_local → combine_local), eager and compiled, over batches of 1–96 tokens: the
    same rows' tokens, group ends and outputs; at most three compiles of each piece."""
    import torch._dynamo

    from vexpert_runtime.model.ep_moe import arrange_local, combine_local

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    experts, hidden, top_k = 8, 16, 2
    table = DeviceRoutingTable.of(static_table(1, experts, 1, 2), "cpu")
    generator = torch.Generator().manual_seed(0)
    for batch in (96, 40, 7, 1):
        x = torch.randn(batch, hidden, generator=generator)
        ids = torch.randint(0, experts, (batch, top_k), generator=generator)
        weights = torch.rand(batch, top_k, generator=generator)
        args = (ids, table.gpu[0], table.local[0], table.cum_share[0], experts, 2, 16)
        eager, fused = arrange_local(*args), compiled(arrange_local)(*args)
        position = eager[1]
        assert all(torch.equal(a, b) for a, b in zip(eager, fused, strict=True))
        out = x[eager[0]] * 2.0  # any per-row "expert" will do
        out[position.max() + 1:] = float("nan")  # rows no pair landed on are never read
        torch.testing.assert_close(compiled(combine_local)(out, position, weights, None),
                                   combine_local(out, position, weights, None))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 6  # 2 pieces × (first batch static, batch > 1 symbolic, batch 1)


def test_w8a8s_activation_quantisation_compiled_is_bit_for_bit_the_eager_one() -> None:
    """What the EP layer hands W8A8's GEMMs where it fuses: the compiled per-token-group quantisation gives the
    eager one's fp8 bytes and scales over every batch size (partial groups too), in at most three compiles."""
    import torch._dynamo

    from vexpert_runtime.model.fp8_activations import quantize_activation_groups

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    generator = torch.Generator().manual_seed(1)
    for rows, cols in ((96, 320), (40, 320), (7, 320), (1, 320), (33, 200)):
        x = torch.randn(rows, cols, generator=generator) * 4
        x[0, :64] = 0.0  # a group of zeros (the scale's floor) beside others
        q, scale = quantize_activation_groups(x, 64)
        fused_q, fused_scale = compiled(quantize_activation_groups)(x, 64)
        assert torch.equal(q.view(torch.uint8), fused_q.view(torch.uint8)) and torch.equal(scale, fused_scale)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 4  # three for the row counts, one for the 200-wide input


@pytest.mark.parametrize("cols", [200, 256])
def test_w8a8s_wire_rows_and_their_consumers_compile_to_the_eager_numbers(cols: int) -> None:
    """The quantisation fused into what consumes it: the dispatch's wire rows (values and scales in one uint8 row)
    and the dequantised round trip, compiled fresh at a width whose last 128-column group is partial (200) and
    one whose is not, 33 rows and 1. The padded-tile, ``repeat_interleave`` and in-graph-indexed forms compiled to
    reads of garbage at 200 (``benchmarks/inductor_partial_group.py``); this holds the product's form to the eager
    bytes."""
    import torch._dynamo

    from vexpert_runtime.model.fp8_activations import fp8_activation_round_trip, quantized_wire_rows

    for batch, dtype in ((33, torch.float32), (33, torch.bfloat16), (1, torch.float32)):  # 1 row: the indexed form
        torch._dynamo.reset()                                                           # failed only there
        rows = (torch.randn(batch, cols, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
        assert torch.equal(torch.compile(quantized_wire_rows)(rows, 128), quantized_wire_rows(rows, 128))
        assert torch.equal(torch.compile(fp8_activation_round_trip)(rows, 128), fp8_activation_round_trip(rows, 128))


def test_the_compiled_step_equals_the_eager_step_for_deepseek_v3(tmp_path: Path) -> None:
    """DeepSeek-V3 (MLA, grouped router with a correction bias, a shared expert, a dense layer) on
    one EP rank in float32: :meth:`HFStepModel.compile_pieces` compiles transformers' norms, router,
    shared expert and dense MLP, and our step inputs (embedding, rotary embedding), attention inputs, EP bookkeeping and
    sampling — and a continuous batch (joins, 4-token prompt chunks, leaves) gives the eager
    tokens, with no graph break anywhere."""
    import torch._dynamo

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    path = _write("deepseek_v3", tmp_path / "ds3")
    outputs = []
    for fuse in (False, True):
        model = HFStepModel(path, dtype=torch.float32, kv_cache_tokens=512)
        model.executor = EPExperts.for_model(model, 0, 1, None)
        model.drop_expert_weights()
        if fuse:
            assert model.compile_pieces() == 1 + 2 * 2 + 1  # the first layer's input norm (the others run inside
            # the compiled residual add, add_and_norm; the final norm inside norm_rows; the rotary embedding inside
            # step_inputs); 2 sparse blocks' router + shared expert; 1 dense MLP
        # A rank's iteration 0 at start is an empty step (eager on CPU): the pieces' first call sees no rows.
        assert model.step([]).shape == (0,)
        outputs.append(drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK))
    assert outputs[0] == outputs[1]
    assert [len(o) for o in outputs[1]] == list(NEW_TOKENS)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] >= 8  # the pieces really ran compiled


def test_an_empty_ep_layer_call_with_slots_runs_eagerly_when_compiled() -> None:
    """A rank's first iteration is an empty step: inductor fails to compile the layout of zero rows
    with slots in the table, so ``ep_moe_layer(compiled=True)`` runs an empty call eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    experts, slots, hidden, intermediate, top_k = 8, 2, 16, 4, 2
    table = DeviceRoutingTable.of(static_table(1, experts, 1, slots), "cpu")
    rows = torch.randn(experts, 3 * intermediate * hidden)
    stacks = ExpertStacks(rows, torch.randn(slots, 3 * intermediate * hidden), intermediate)
    y, stats = ep_moe_layer(torch.zeros(0, hidden), torch.zeros(0, top_k, dtype=torch.int64), torch.zeros(0, top_k),
                            table, 0, stacks, None, 0, 1, None, compiled=True)
    assert y.shape == (0, hidden) and int(stats.computed.sum()) == 0
