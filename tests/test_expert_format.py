"""Block-FP8 experts (DeepSeek-V3/R1, Kimi-K2 checkpoints) in their own format: the packed row
layout, the checkpoint reader, the EP forward against the dequantised reference, the node with
``--verify``, bad checkpoints, and the operator's sizing of the DeepSeek-V3 example."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from runtime_support import TINY_FP8_DEEPSEEK_SPEC
from vexpert_runtime import cli
from vexpert_runtime.config import parse_runtime_config
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import (
    SCALE_SUFFIX,
    CheckpointReader,
    MoESpec,
    expert_tensor,
    random_weights,
    read_model_spec,
    resolve_expert_storage,
    shared_tensor,
    write_checkpoint,
    write_tiny_checkpoint,
)
from vexpert_runtime.model.ep_moe import DeviceRoutingTable, ExpertStacks, ep_moe_layer, static_table
from vexpert_runtime.model.expert_format import ExpertFormat, dequantize_fp8_block, quantize_fp8_block
from vexpert_runtime.model.expert_layout import DENSE, FP8_BLOCK, Fp8RowLayout, expert_row_bytes
from vexpert_runtime.model.moe_math import expert_ffn, relative_error, shared_forward
from vexpert_runtime.model.reference import VERIFY_TOLERANCE, ModelWeights, reference_moe_layer
from vexpert_runtime.model.routing import route
from vexpert_runtime.node.expert_pool import ExpertPool
from vexpert_runtime.ports import free_port

REPO = Path(__file__).resolve().parents[1]
BLOCK = (128, 128)

FP8_SPEC = TINY_FP8_DEEPSEEK_SPEC


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt", FP8_SPEC, seed=5)


# ------------------------------------------------------------------------------------ layout


def test_deepseek_v3_fp8_row_is_44_mb_and_16_byte_aligned() -> None:
    layout = Fp8RowLayout(intermediate=2048, hidden=7168)
    scales = 3 * 16 * 56 * 4  # gate, up [16, 56] and down [56, 16] float32
    assert layout.row_bytes == 3 * 2048 * 7168 + scales == 44_050_944
    assert layout.row_bytes % 16 == 0 and layout.scales_offset % 16 == 0
    assert expert_row_bytes(DENSE, 2048, 7168, "bfloat16") == 88_080_384


def test_partial_blocks_round_trip_through_a_packed_row() -> None:
    gen = torch.Generator().manual_seed(0)
    inter, hidden = 192, 256
    dense = {"gate": torch.randn(inter, hidden, generator=gen), "up": torch.randn(inter, hidden, generator=gen),
             "down": torch.randn(hidden, inter, generator=gen)}
    quantised = {p: quantize_fp8_block(w, BLOCK) for p, w in dense.items()}
    assert quantised["down"][1].shape == (2, 2) and quantised["gate"][1].shape == (2, 2)
    fmt = ExpertFormat(inter, hidden, torch.float32, BLOCK)
    row = fmt.pack_fp8({p: q for p, (q, _) in quantised.items()}, {p: s for p, (_, s) in quantised.items()})
    assert row.dtype == torch.uint8 and row.numel() == fmt.row_numel == Fp8RowLayout(inter, hidden).row_bytes
    gate, up, down = fmt.weights(row)
    for name, got in (("gate", gate), ("up", up), ("down", down)):
        q, s = quantised[name]
        assert torch.equal(got, dequantize_fp8_block(q, s, BLOCK, torch.float32))
        assert relative_error(got, dense[name]) < 0.08  # e4m3: 3 mantissa bits
    # A stack of rows at a stride (a pool buffer) dequantises the same, row by row.
    stack = torch.stack([row, row.flip(0).clone(), row])
    w13, w2 = fmt.stack_weights(stack)
    assert torch.equal(w13[2, :inter], gate) and torch.equal(w2[2], down)


def test_whole_blocks_dequantise_as_the_broadcast_product() -> None:
    """The tile-broadcast fast path (whole blocks) equals the expanded-scale product bit for bit."""
    weight = torch.randn(3, 256, 384, generator=torch.Generator().manual_seed(1))
    pairs = [quantize_fp8_block(w, BLOCK) for w in weight]
    fp8, scale = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    expanded = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)
    assert torch.equal(dequantize_fp8_block(fp8, scale, BLOCK, torch.float32), fp8.float() * expanded)


# ------------------------------------------------------------------------------------ checkpoint


def test_fp8_checkpoint_is_detected_validated_and_read_as_fp8_rows(fp8_checkpoint: Path) -> None:
    spec = read_model_spec(fp8_checkpoint)
    assert spec == FP8_SPEC
    reader = CheckpointReader(fp8_checkpoint, spec)
    reader.validate()
    rows = reader.experts(1, [0, 3], torch.bfloat16)
    assert rows.dtype == torch.uint8 and rows.shape == (2, spec.expert_numel)
    assert spec.expert_bytes(torch.bfloat16) == Fp8RowLayout(192, 256).row_bytes  # ≈ half of bf16
    fmt = spec.expert_format(torch.float32)
    layer = spec.moe_layers[1]
    want = reader.tensor(expert_tensor(layer, 3, "down"))  # dequantised by the reader
    assert torch.equal(fmt.weights(rows[1])[2], want)
    # The pool holds the same bytes as the reader gives, at row_dtype.
    pool = ExpertPool.build(torch.tensor([[1, 2], [0, 3]]), 4, spec.expert_numel,
                            lambda layer, experts: reader.experts(layer, experts, torch.float32),
                            lambda rows, numel: torch.empty(rows, numel, dtype=spec.row_dtype(torch.float32)))
    assert torch.equal(pool.row(1, 3), rows[1]) and pool.nbytes == 4 * spec.expert_bytes(torch.float32)
    # Shared experts are resident: dequantised at load into the compute dtype.
    shared = reader.shared(0, torch.bfloat16)
    assert shared is not None and shared.gate.dtype == torch.bfloat16
    assert reader.raw(shared_tensor(spec, spec.moe_layers[0], "gate")).dtype == torch.float8_e4m3fn


def test_expert_format_rule(fp8_checkpoint: Path, tmp_path: Path) -> None:
    spec = read_model_spec(fp8_checkpoint)
    assert resolve_expert_storage(spec, "auto").expert_storage == FP8_BLOCK
    dense = resolve_expert_storage(spec, "dense")
    rows = CheckpointReader(fp8_checkpoint, dense).experts(0, [1], torch.float32)
    assert rows.dtype == torch.float32 and rows.shape == (1, 3 * 192 * 256)  # dequantised at load
    plain = write_tiny_checkpoint(tmp_path / "bf16", dataclasses.replace(FP8_SPEC, fp8_block=None, expert_storage=DENSE))
    quantised = resolve_expert_storage(read_model_spec(plain), "fp8_block")  # a dense checkpoint's experts, FP8 rows
    assert quantised.fp8_block is None and quantised.storage_block == (128, 128)
    config = parse_runtime_config({"model": {"expert_format": "fp8_block", "dtype": "bfloat16"}})
    assert config.model.expert_format == "fp8_block"
    with pytest.raises(VExpertInputError, match=r"model\.expert_format"):
        parse_runtime_config({"model": {"expert_format": "int4"}})
    # model.expert_compute: W8A8 multiplies FP8 rows (carried by the format every executor reads), never dense ones
    w8a8 = resolve_expert_storage(spec, "auto", "w8a8")
    assert w8a8.fp8_activations and w8a8.expert_format(torch.bfloat16).fp8_activations
    assert not resolve_expert_storage(spec, "auto").expert_format(torch.bfloat16).fp8_activations
    with pytest.raises(VExpertInputError, match=r"model\.expert_compute.*fp8_block"):
        resolve_expert_storage(spec, "dense", "w8a8")
    with pytest.raises(VExpertInputError, match=r"model\.expert_compute"):
        parse_runtime_config({"model": {"expert_compute": "w4a8"}})
    assert parse_runtime_config({}).model.linear_format == "dense"  # FP8 linears dequantised unless asked
    with pytest.raises(VExpertInputError, match=r"model\.linear_format"):
        parse_runtime_config({"model": {"linear_format": "fp4"}})


def test_a_dense_checkpoints_experts_are_quantised_at_load(tmp_path: Path) -> None:
    """``model.expert_format: fp8_block`` on a dense checkpoint: each expert projection is quantised as it is read,
    in 128 × 128 blocks (partial at I 192), into the same row an FP8 checkpoint of those weights gives; the reference
    model (``--verify``'s) reads the rows dequantised, within e4m3's error of the dense weights."""
    dense_spec = dataclasses.replace(FP8_SPEC, fp8_block=None, expert_storage=DENSE)
    plain = write_tiny_checkpoint(tmp_path / "dense", dense_spec, seed=6)
    spec = resolve_expert_storage(read_model_spec(plain), "fp8_block")
    reader = CheckpointReader(plain, spec)
    reader.validate()
    fmt = spec.expert_format(torch.float32)
    assert fmt.fp8_block == BLOCK
    rows = reader.experts(1, [0, 3], torch.float32)
    assert rows.dtype == torch.uint8 and rows.shape == (2, Fp8RowLayout(192, 256).row_bytes)
    dense = CheckpointReader(plain, read_model_spec(plain)).experts(1, [0, 3], torch.float32)
    layer = spec.moe_layers[1]
    for i, expert in enumerate((0, 3)):
        weights = {p: reader.tensor(expert_tensor(layer, expert, p)) for p in ("gate", "up", "down")}
        quantised = {p: quantize_fp8_block(w, BLOCK) for p, w in weights.items()}
        want = fmt.pack_fp8({p: q for p, (q, _) in quantised.items()}, {p: s for p, (_, s) in quantised.items()})
        assert torch.equal(rows[i], want)
        assert 0 < relative_error(fmt.dense_rows(rows[i : i + 1]), dense[i : i + 1]) < 0.08
    reference = ModelWeights.load(reader, torch.float32)
    assert torch.equal(reference.experts[1][3], fmt.dense_rows(rows[1:2])[0])


def _broken(tmp_path: Path, edit: str) -> Path:
    weights = random_weights(FP8_SPEC, seed=1)
    name = expert_tensor(FP8_SPEC.moe_layers[0], 2, "down")
    if edit == "scale_shape":
        weights[name + SCALE_SUFFIX] = torch.ones(2, 3)
    elif edit == "scale_dtype":
        weights[name + SCALE_SUFFIX] = weights[name + SCALE_SUFFIX].to(torch.bfloat16)
    elif edit == "not_fp8":
        weights[name] = weights[name].to(torch.float32)
    elif edit == "no_scale":
        del weights[name + SCALE_SUFFIX]
    return write_checkpoint(tmp_path / edit, FP8_SPEC, weights)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("scale_shape", r"experts\.2\.down_proj\.weight_scale_inv .* has shape \[2, 3\], config.json implies \[2, 2\]"),
        ("scale_dtype", r"experts\.2\.down_proj\.weight_scale_inv .* has dtype BF16; block scales .* must be F32"),
        ("not_fp8", r"experts\.2\.down_proj\.weight .* has dtype F32, but config.json's quantization_config"),
        ("no_scale", r"tensor .*experts\.2\.down_proj\.weight_scale_inv is missing"),
    ],
)
def test_bad_fp8_checkpoint_names_the_tensor(tmp_path: Path, edit: str, message: str) -> None:
    path = _broken(tmp_path, edit)
    with pytest.raises(VExpertInputError, match=message):
        CheckpointReader(path, read_model_spec(path)).validate()


def test_fp8_weights_without_quantization_config_or_unsupported_configs(fp8_checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((fp8_checkpoint / "config.json").read_text())
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with pytest.raises(VExpertInputError, match=r"is F8_E4M3, but config\.json has no FP8 quantization_config"):
        CheckpointReader(fp8_checkpoint, read_model_spec_from(tmp_path / "a", plain)).validate()
    for key, value, message in (
        ("quant_method", "gptq", "quantization_config.quant_method.*'gptq' is not supported"),
        ("fmt", "e5m2", "quantization_config.fmt.*only e4m3"),
        ("weight_block_size", None, "quantization_config.weight_block_size.*per-tensor FP8 is not supported"),
    ):
        bad = {**config, "quantization_config": {**config["quantization_config"], key: value}}
        with pytest.raises(VExpertInputError, match=message):
            read_model_spec_from(tmp_path / key, bad)


def read_model_spec_from(path: Path, config: dict[str, object]) -> MoESpec:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return read_model_spec(path)


# ------------------------------------------------------------------------------------ compute


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ep_forward_of_fp8_rows_matches_the_dequantised_reference(fp8_checkpoint: Path, grouped: bool,
                                                                  dtype: torch.dtype) -> None:
    """One rank holding every expert as FP8 rows: the loop path (dequantise each row) and the
    grouped-GEMM path (dequantise the stack into a scratch, torch._grouped_mm also runs on CPU)."""
    spec = read_model_spec(fp8_checkpoint)
    reader = CheckpointReader(fp8_checkpoint, spec)
    reference = ModelWeights.load(reader, dtype)
    assert reference.experts[0].dtype == dtype and reference.experts[0].shape[1] == 3 * 192 * 256
    fmt = spec.expert_format(dtype)
    x = torch.randn(24, spec.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    table = DeviceRoutingTable.of(static_table(spec.num_layers, spec.num_experts, 1, 0), "cpu")
    for layer in range(spec.num_layers):
        rows = reader.experts(layer, list(range(spec.num_experts)), dtype)
        ids, weights = route(x, reference.routers[layer], spec)
        shared = shared_forward(x, reference.shared[layer])
        stacks = ExpertStacks(rows, None, spec.intermediate_size, grouped=grouped, format=fmt)
        y, _ = ep_moe_layer(x, ids, weights, table, layer, stacks, shared, 0, 1, None)
        ref, _ = reference_moe_layer(x, reference, layer)
        tolerance = 1e-5 if dtype == torch.float32 else VERIFY_TOLERANCE["bfloat16"]
        assert relative_error(y, ref) <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_tokens_cross_the_dispatch_quantised_and_compute_the_reference(
        fp8_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """W8A8 (FP8 rows × FP8 activations): each token is quantised once before the dispatch all-to-all and crosses
    it as a wire row (its FP8 values, then its float32 scales: ~half a bf16 row's bytes) — and the layer still
    computes the W8A8 reference, which quantises each expert GEMM's rows after routing: per-row quantisation
    commutes with the dispatch's row copies. What enters the dispatch is watched through the module's own function
    (one rank: the rows its experts read in place)."""
    from vexpert_runtime.model import ep_moe
    from vexpert_runtime.model.fp8_activations import wire_row_bytes

    spec = resolve_expert_storage(read_model_spec(fp8_checkpoint), "auto", "w8a8")
    reader = CheckpointReader(fp8_checkpoint, spec)
    reference = ModelWeights.load(reader, dtype)
    fmt = spec.expert_format(dtype)
    assert fmt.fp8_activations and fmt.fp8_block is not None
    sent: list[torch.Tensor] = []
    experts = ep_moe.stacked_outputs
    monkeypatch.setattr(ep_moe, "stacked_outputs", lambda tokens, *args: (sent.append(tokens), experts(tokens, *args))[1])
    x = torch.randn(24, spec.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    table = DeviceRoutingTable.of(static_table(spec.num_layers, spec.num_experts, 1, 0), "cpu")
    for layer in range(spec.num_layers):
        ids, weights = route(x, reference.routers[layer], spec)
        stacks = ExpertStacks(reader.experts(layer, list(range(spec.num_experts)), dtype), None,
                              spec.intermediate_size, format=fmt)
        y, _ = ep_moe_layer(x, ids, weights, table, layer, stacks, shared_forward(x, reference.shared[layer]),
                            0, 1, None)
        ref, _ = reference_moe_layer(x, reference, layer)
        assert y.dtype == dtype and relative_error(y, ref) <= (1e-5 if dtype == torch.float32 else
                                                               VERIFY_TOLERANCE["bfloat16"])
        wire = sent[-1]
        assert wire.dtype == torch.uint8 and wire.shape == (x.shape[0], wire_row_bytes(spec.hidden_size,
                                                                                      fmt.fp8_block[1]))
        assert wire.shape[1] < 0.6 * spec.hidden_size * 2  # against a bf16 row's bytes
    # W8A16 sends rows of the compute dtype, as before
    w8a16 = ExpertStacks(reader.experts(0, list(range(spec.num_experts)), dtype), None, spec.intermediate_size,
                         format=dataclasses.replace(fmt, fp8_activations=False))
    ids, weights = route(x, reference.routers[0], spec)
    ep_moe_layer(x, ids, weights, table, 0, w8a16, None, 0, 1, None)
    assert sent[-1].dtype == dtype and sent[-1].shape == (x.shape[0], spec.hidden_size)


def test_w8a8_swiglu_over_wire_rows_is_w8a8_swiglu_over_the_rows(fp8_checkpoint: Path) -> None:
    """The CPU ranks' W8A8 experts (and the GPU kernel's twin) given the dispatch's wire rows compute, bit for bit,
    what they compute quantising the same rows themselves — float32 and bf16, hidden sizes with a partial
    activation group and a width that is not a multiple of 4 (padded before the scales)."""
    from vexpert_runtime.model.expert_format import w8a8_swiglu
    from vexpert_runtime.model.fp8_activations import quantized_wire_rows, unpack_wire_rows, wire_row_bytes

    generator = torch.Generator().manual_seed(4)
    for hidden, group, dtype in ((256, 128, torch.float32), (200, 128, torch.bfloat16), (198, 64, torch.float32)):
        x = (torch.randn(19, hidden, generator=generator) * 3).to(dtype)
        w13 = torch.randn(3, 2 * 48, hidden, generator=generator).to(dtype) / hidden ** 0.5
        w2 = torch.randn(3, hidden, 48, generator=generator).to(dtype) / 48 ** 0.5
        offs = torch.tensor([5, 5, 17], dtype=torch.int32)
        wire = quantized_wire_rows(x, group)
        assert wire.shape == (19, wire_row_bytes(hidden, group)) and wire_row_bytes(hidden, group) % 4 == 0
        quantised, scales = unpack_wire_rows(wire, hidden)
        assert quantised.shape == (19, hidden) and scales.shape == (19, -(-hidden // group))
        assert torch.equal(w8a8_swiglu(quantised, w13, w2, offs, group, scales), w8a8_swiglu(x, w13, w2, offs, group))
    with pytest.raises(ValueError, match="4-byte-aligned"):
        unpack_wire_rows(wire[:, 1:], hidden)


def test_fp8_reference_is_close_to_the_unquantised_model(fp8_checkpoint: Path) -> None:
    """Sanity of the dequantisation itself: FP8 weights compute what their fp32 originals do, to
    the precision of e4m3 (the checkpoint writer quantised random fp32 weights)."""
    spec = read_model_spec(fp8_checkpoint)
    reader = CheckpointReader(fp8_checkpoint, spec)
    originals = random_weights(dataclasses.replace(spec, fp8_block=None, expert_storage=DENSE), seed=5)
    x = torch.randn(8, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    layer = spec.moe_layers[0]
    fp8 = spec.expert_format(torch.float32).ffn(x, reader.experts(0, [1], torch.float32)[0])
    exact = expert_ffn(x, *(originals[expert_tensor(layer, 1, p)] for p in ("gate", "up", "down")))
    assert relative_error(fp8, exact) < 0.1


@pytest.mark.parametrize("compute", ["w8a16", "w8a8"])
def test_node_with_fp8_experts_verifies_against_the_dequantised_reference(
        fp8_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], compute: str) -> None:
    """Two CPU workers, FP8 pool and slots, a plan with vExperts (τ = 0.95, k = 2): ``--verify`` (W8A8: the
    reference quantises each expert GEMM's activations alike, the workers' experts emulate the GPU kernel)."""
    raw = {
        "model": {"checkpoint_path": str(fp8_checkpoint), "dtype": "float32", "expert_format": "fp8_block",
                  "expert_compute": compute},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": 0.95},
        "tuning": {"allocation_interval": 2},
        "runtime": {"device": "cpu", "cpu_workers": 2, "metrics_port": 0},
    }
    config = tmp_path / "runtime.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert cli.main(["node", "--config", str(config), "--iterations", "6", "--verify"]) == 0
    summary = [line for line in capsys.readouterr().err.splitlines() if "stopped after 6 iterations" in line]
    assert len(summary) == 1, summary
    assert 0 <= float(summary[0].split("max rel error ")[1]) <= VERIFY_TOLERANCE["float32"]


# ------------------------------------------------------------------------------------ operator


def test_operator_sizes_the_deepseek_v3_example_with_fp8_bytes() -> None:
    from vexpert_operator.api import VExpertDeploymentSpec
    from vexpert_operator.manifests import build_runtime_config
    from vexpert_operator.sizing import gpu_bytes_per_gpu, model_shape, size_pod
    from vexpert_runtime.policy.profile import PerformanceProfile

    docs = yaml.safe_load_all((REPO / "examples" / "deepseek-v3-ep64.yaml").read_text())
    raw = next(d for d in docs if d and d.get("kind") == "VExpertDeployment")  # beside its checkpoint claim
    spec = VExpertDeploymentSpec.model_validate(raw["spec"])
    shape = model_shape(spec)
    assert shape is not None and shape.expert_bytes == Fp8RowLayout(2048, 7168).row_bytes  # ≈ 44 MB
    assert 44e6 < shape.expert_bytes < 44.1e6
    dense = model_shape(spec.model_copy(update={"model": spec.model.model_copy(update={"expert_format": "dense"})}))
    assert dense is not None and dense.expert_bytes == 3 * 2048 * 7168 * 2
    # W8A8 on dense rows is refused at admission, naming both fields (the runtime would refuse it at start)
    model = {**raw["spec"]["model"], "expertFormat": "dense", "expertCompute": "w8a8"}
    with pytest.raises(ValueError, match=r"model\.expertCompute.*expertFormat"):
        VExpertDeploymentSpec.model_validate({**raw["spec"], "model": model})
    w8a8 = VExpertDeploymentSpec.model_validate({**raw["spec"], "model": {**raw["spec"]["model"], "expertCompute": "w8a8",
                                                                          "linearFormat": "fp8_block"}})
    rendered = build_runtime_config(w8a8, "dsv3", "inference", PerformanceProfile(), 10, None,
                                    size_pod(w8a8, model_shape(w8a8), None))
    pods = parse_runtime_config(yaml.safe_load(rendered.to_yaml())).model
    assert (pods.expert_compute, pods.linear_format) == ("w8a8", "fp8_block")  # both reach the pods
    assert gpu_bytes_per_gpu(spec, shape) < gpu_bytes_per_gpu(spec, dense)


def test_w8a8_is_refused_on_gpus_without_fp8_tensor_cores_and_on_narrow_blocks(
        fp8_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU node checks at start (``node/setup.check_fp8_options``), with the GPU's answers stubbed here: an
    A100 (compute capability 8.0) has no FP8 tensor cores; FP8 dots want blocks of 32+ columns; an H100 with
    128-wide blocks passes."""
    from vexpert_runtime.node.setup import check_fp8_options

    spec = resolve_expert_storage(read_model_spec(fp8_checkpoint), "auto", "w8a8")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    with pytest.raises(VExpertInputError, match=r"model\.expert_compute.*FP8 tensor cores.*A100.*capability 8\.0\) has none"):
        check_fp8_options(spec, "dense", "cuda")
    check_fp8_options(spec, "dense", "cpu")  # CPU ranks emulate it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    check_fp8_options(spec, "fp8_block", "cuda")
    narrow = dataclasses.replace(spec, fp8_block=(16, 16))
    with pytest.raises(VExpertInputError, match=r"model\.expert_compute.*32 or more"):
        check_fp8_options(narrow, "dense", "cuda")


def test_expert_compute_auto_is_w8a8_for_fp8_rows_on_gpus_with_fp8_tensor_cores(
        fp8_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.expert_compute: auto`` (the default), resolved per node (``node/setup.resolve_expert_compute``; the
    GPU's answers stubbed): W8A8 for FP8 rows on an H100 (as vLLM and SGLang serve a block-FP8 checkpoint there),
    W8A16 on an A100, on CPU ranks, for blocks narrower than FP8 dots take and for dense rows; explicit choices
    pass through unchanged."""
    from vexpert_runtime.node.setup import resolve_expert_compute

    assert parse_runtime_config({}).model.expert_compute == "auto"
    fp8_rows = resolve_expert_storage(read_model_spec(fp8_checkpoint), "auto")
    dense_rows = resolve_expert_storage(read_model_spec(fp8_checkpoint), "dense")
    quantised_at_load = resolve_expert_storage(read_model_spec(write_tiny_checkpoint(
        tmp_path / "bf16", dataclasses.replace(FP8_SPEC, fp8_block=None, expert_storage=DENSE))), "fp8_block")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert resolve_expert_compute("auto", fp8_rows, "cuda") == "w8a8"
    assert resolve_expert_compute("auto", quantised_at_load, "cuda") == "w8a8"  # 128 x 128 blocks
    assert resolve_expert_compute("auto", dense_rows, "cuda") == "w8a16"
    assert resolve_expert_compute("auto", dataclasses.replace(fp8_rows, fp8_block=(16, 16)), "cuda") == "w8a16"
    assert resolve_expert_compute("auto", fp8_rows, "cpu") == "w8a16"
    assert resolve_expert_compute("w8a16", fp8_rows, "cuda") == "w8a16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    assert resolve_expert_compute("auto", fp8_rows, "cuda") == "w8a16"
    assert resolve_expert_compute("w8a8", fp8_rows, "cpu") == "w8a8"  # asked for: emulated
    assert not resolve_expert_storage(read_model_spec(fp8_checkpoint), "auto", "auto").fp8_activations  # no device
