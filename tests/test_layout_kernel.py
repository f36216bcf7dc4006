"""The EP layer's layout in one kernel (model/layout_kernel.py) against its torch twin, arrange_received /
arrange_local: in Triton's interpreter on CPU (CI has no GPU), compiled for Hopper, and on a GPU where one is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime_support import run_in_triton_interpreter


def _received_cases(device: str) -> list[tuple[torch.Tensor, int, int, int]]:
    """(recv_local [T] with −1 padding, resident, slots, align): one chunk and several (T × groups past 8,192
    one-hot entries), no slots, every row padding, one row, aligned groups and not."""
    generator = torch.Generator().manual_seed(11)
    cases = []
    for rows, resident, slots, align, pad in ((1, 1, 0, 16, 0.0), (7, 4, 2, 1, 0.3), (64, 8, 3, 16, 0.2),
                                              (513, 8, 0, 16, 0.1), (3000, 4, 2, 16, 0.5), (1024, 8, 6, 16, 0.0),
                                              (40, 3, 1, 16, 1.0), (4096, 12, 3, 16, 0.25)):
        local = torch.randint(0, resident + slots, (rows,), generator=generator)
        local[torch.rand(rows, generator=generator) < pad] = -1
        cases.append((local.to(device), resident, slots, align))
    return cases


def _assert_received_equal(device: str) -> None:
    from vexpert_runtime.model.ep_moe import arrange_received
    from vexpert_runtime.model.layout_kernel import fused_arrange_received

    for recv_local, resident, slots, align in _received_cases(device):
        want = arrange_received(recv_local, resident, slots, align)
        got = fused_arrange_received(recv_local, resident, slots, align)
        for name, a, b in zip(("row_src", "position", "resident_offs", "slot_offs", "computed"), got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (recv_local.numel(), resident, slots, align, name)


def _assert_local_equal(device: str) -> None:
    """One rank's pairs (a table of one copy per expert, as every table of an EP group of one is)."""
    from vexpert_runtime.model.ep_moe import DeviceRoutingTable, arrange_local, static_table
    from vexpert_runtime.model.layout_kernel import fused_arrange_local

    generator = torch.Generator().manual_seed(3)
    for experts, top_k, batch, slots, align in ((8, 2, 256, 2, 16), (16, 4, 7, 0, 1), (64, 8, 100, 1, 16),
                                                (8, 2, 1, 3, 16)):
        table = DeviceRoutingTable.of(static_table(2, experts, 1, slots), device)
        ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(batch)]).to(device)
        gpu, local, cum = table.gpu[1], table.local[1], table.cum_share[1]
        assert local.shape[1] == 1
        want = arrange_local(ids, gpu, local, cum, experts, slots, align)
        got = fused_arrange_local(ids, local, experts, slots, align)
        for name, a, b in zip(("row_src", "position", "resident_offs", "slot_offs", "computed"), got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (experts, top_k, batch, slots, align, name)


def check_layout_kernel_on_cpu() -> None:
    """Run with TRITON_INTERPRET=1 (see the test below)."""
    _assert_received_equal("cpu")
    _assert_local_equal("cpu")


def test_the_layout_kernel_equals_its_torch_twin_in_the_interpreter() -> None:
    """Every output equal (exact integers): positions of real and padding rows, row sources, group ends, counts —
    over one chunk of one-hot rows and several, with and without slots, aligned groups and not, one rank's pairs."""
    pytest.importorskip("triton")
    run_in_triton_interpreter("test_layout_kernel", "check_layout_kernel_on_cpu")


def test_the_layout_kernel_compiles_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel compiles to sm_90 machine code (Triton ships ptxas: no GPU needed), both forms — received rows
    and one rank's pairs looked up — with the barrier between the buffer's zeros and the rows' entries."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vexpert_runtime.model import layout_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, do not reuse
    pointers = {"group_src": "*i64", "local_table": "*i64", "stride_table": "i32", "row_src": "*i64",
                "position": "*i64", "resident_offs": "*i32", "slot_offs": "*i32", "computed": "*i64",
                "T": "i32", "M": "i32", "resident_rows": "i32"}
    for lookup, token_div in ((False, 1), (True, 2)):
        constants = {"RESIDENT": 8, "SLOTS": 2, "ALIGN": 16, "LOOKUP": lookup, "TOKEN_DIV": token_div, "GP": 16,
                     "CHUNK": 512, "ZERO_BLOCK": 1024}
        source = ASTSource(fn=layout_kernel._layout_kernel,
                           signature={**pointers, **dict.fromkeys(constants, "constexpr")}, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert len(compiled.asm["cubin"]) > 0 and "bar.sync" in compiled.asm["ptx"]


def test_the_layout_kernel_runs_on_cuda_within_its_limit_only() -> None:
    from vexpert_runtime.model.dispatch import triton_available
    from vexpert_runtime.model.ep_moe import FUSED_LAYOUT_LIMIT, fused_layout_runs

    cuda = torch.device("cuda")
    assert not fused_layout_runs(torch.device("cpu"), 512, 8, 2)  # the CPU twin runs there
    assert not fused_layout_runs(cuda, 0, 8, 2)  # an empty step: nothing to lay out
    big = FUSED_LAYOUT_LIMIT // 11 + 1
    assert not fused_layout_runs(cuda, big, 8, 2)  # past one block's chunks: the compiled torch code
    assert fused_layout_runs(cuda, big - 1, 8, 2) is triton_available()


def test_the_fused_one_rank_layout_refuses_replicated_tables() -> None:
    pytest.importorskip("triton")
    from vexpert_runtime.model.layout_kernel import fused_arrange_local

    with pytest.raises(ValueError, match="one copy per expert"):
        fused_arrange_local(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(8, 2, dtype=torch.int64), 8, 1, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_layout_kernel_equals_its_torch_twin_on_the_gpu() -> None:
    _assert_received_equal("cuda")
    _assert_local_equal("cuda")
