"""fp32 CPU linears through oneDNN (:mod:`vexpert_runtime.model.cpu_linear`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vexpert_runtime.model import cpu_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _ops(fn: object) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()  # type: ignore[operator]
    return {event.key for event in prof.key_averages()}


@needs_onednn
@pytest.mark.parametrize("shape", [(24, 64), (2, 9, 64), (0, 64), (3, 64)])
def test_linear_equals_f_linear_through_onednn_from_16_rows(shape: tuple[int, ...]) -> None:
    x, w, b = torch.randn(shape), torch.randn(cpu_linear.MIN_OUT_FEATURES, 64), torch.randn(cpu_linear.MIN_OUT_FEATURES)
    torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w))
    rows = x.numel() // x.shape[-1]
    assert ("mkldnn::_linear_pointwise" in _ops(lambda: cpu_linear.linear(x, w, b))) == (rows >= cpu_linear.MIN_ROWS)


@needs_onednn
def test_narrow_outputs_take_the_blas() -> None:
    x, w = torch.randn(64, 64), torch.randn(cpu_linear.MIN_OUT_FEATURES - 1, 64)
    assert "mkldnn::_linear_pointwise" not in _ops(lambda: cpu_linear.linear(x, w))


def test_other_dtypes_take_f_linear() -> None:
    x, w = torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(256, 16, dtype=torch.bfloat16)
    assert not cpu_linear.onednn_runs(w)
    assert "mkldnn::_linear_pointwise" not in _ops(lambda: cpu_linear.linear(x, w))
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w))


@needs_onednn
def test_routing_a_model_keeps_its_outputs_and_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.SiLU(), nn.Linear(256, 128, bias=False), nn.Linear(8, 8).to(torch.bfloat16))
    x = torch.randn(20, 16)
    before = model[2](model[1](model[0](x)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert cpu_linear.route_linears_to_onednn(model) == 2  # the bf16 layer keeps F.linear
    after = model[2](model[1](model[0](x)))
    torch.testing.assert_close(after, before)
    assert "mkldnn::_linear_pointwise" in _ops(lambda: model[0](x))
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


@needs_onednn
def test_a_routed_linear_compiles_without_a_graph_break() -> None:
    """Inside torch.compile the routed forward is plain F.linear (inductor's lowering of the oneDNN
    op wants a frozen weight): the compiled module runs, equals eager, and does not break its graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = nn.Linear(16, 256)
    cpu_linear.route_linears_to_onednn(layer)
    x = torch.randn(32, 16)
    eager = layer(x)
    layer.compile(dynamic=True)
    torch.testing.assert_close(layer(x), eager)
    assert not counters["graph_break"]
