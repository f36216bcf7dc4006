"""load_without_experts: a rank loads every tensor of a Hugging Face MoE checkpoint but the routed experts.

Tiny random DeepSeek-V3 (MLA, dense first layer), Qwen3-MoE and Qwen2-MoE checkpoints are written
with ``save_pretrained`` (float32). The loaded model must equal ``from_pretrained``'s tensor for
tensor (non-persistent rotary buffers included) with the routed experts left on meta, read exactly
the non-expert bytes of the shards (counted against the safetensors headers), refuse a checkpoint
with a missing or wrong-shaped tensor before reading anything, and — on an expert-heavy checkpoint
of about 1.2 GB — start a rank with a peak RSS of about its non-expert weights plus its own experts.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vexpert_runtime.errors import VExpertInputError  # noqa: E402
from vexpert_runtime.model.checkpoint import (  # noqa: E402
    INDEX_FILE,
    PROJECTIONS,
    expert_tensor,
    projection_shape,
)
from vexpert_runtime.model.expert_format import dequantize_fp8_block, quantize_fp8_block  # noqa: E402
from vexpert_runtime.serve import model_loading  # noqa: E402
from vexpert_runtime.serve.fp8_linear import Fp8Linear  # noqa: E402
from vexpert_runtime.serve.model_loading import LoadReport, load_without_experts  # noqa: E402
from vexpert_runtime.serve.sparse_blocks import is_sparse_block  # noqa: E402

FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe")
EXPERTS = ".mlp.experts."  # every routed-expert tensor name (checkpoint and model) contains it


def _config(family: str, **overrides: Any) -> Any:
    """A tiny config of ``family`` (as tests/test_serve_model.py): 3 layers (DeepSeek: the first
    dense), 8 experts, top-2."""
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_experts_per_tok": 2,
              "max_position_embeddings": 128, "initializer_range": 0.15, "eos_token_id": None,
              "bos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False, **overrides}
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
            n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=8,
                                           norm_topk_prob=True)
    return transformers.Qwen2MoeConfig(**common, num_key_value_heads=2, num_experts=8,
                                       shared_expert_intermediate_size=48)


def _write(family: str, path: Path, **overrides: Any) -> Path:
    torch.manual_seed(FAMILIES.index(family))
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **overrides))
    if family == "deepseek_v3":  # a non-zero correction bias, so a wrong or skipped buffer shows
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: _write(family, root / family) for family in FAMILIES}


def _reference(path: Path, dtype: torch.dtype) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones included) by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _header_bytes(path: Path) -> dict[str, int]:
    """Tensor name → bytes of its data, from the raw safetensors headers of every shard (not via
    safetensors: an independent count of what a loader must read)."""
    out: dict[str, int] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with shard.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        out.update({name: entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()})
    return out


def _rewrite(src: Path, dst: Path, change: Any) -> Path:
    """A copy of a single-file checkpoint whose tensors went through ``change(dict) -> dict``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    save_file(change(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------------------------------------
# The loaded model equals from_pretrained's, experts aside
# ---------------------------------------------------------------------------------------------


def _assert_like_reference(model: Any, reference: Any, device: torch.device) -> None:
    """Every non-expert parameter and buffer of ``model`` equals the reference's (value, dtype, on
    ``device``), the routed experts are still on meta, the rotary cos/sin are the same, and with the
    reference's experts grafted in the logits are identical."""
    ours, theirs = _tensors(model), _tensors(reference)
    assert ours.keys() == theirs.keys()
    experts = {name for name in ours if EXPERTS in name}
    assert experts and all(ours[name].is_meta for name in experts)  # never materialised
    for name in ours.keys() - experts:
        assert ours[name].device == device, name
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name], theirs[name]), name
    assert not model.training
    # The sparse blocks are still recognisable (their experts modules keep gate_up_proj, on meta).
    assert [is_sparse_block(layer.mlp) for layer in model.model.layers] == \
        [is_sparse_block(layer.mlp) for layer in reference.model.layers]

    positions = torch.arange(40, device=device).unsqueeze(0)
    probe = torch.zeros(1, 40, 8, dtype=model.dtype, device=device)
    for got, want in zip(model.model.rotary_emb(probe, positions), reference.model.rotary_emb(probe, positions),
                         strict=True):
        assert torch.equal(got, want)

    for layer, ref_layer in zip(model.model.layers, reference.model.layers, strict=True):
        if is_sparse_block(ref_layer.mlp):
            layer.mlp.experts = ref_layer.mlp.experts  # what the caller's proxy would compute
    ids = torch.tensor([[5, 9, 17, 40, 2, 7, 8, 61, 33, 12]], device=device)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize(("family", "dtype"), [*((f, torch.float32) for f in FAMILIES),
                                               ("deepseek_v3", torch.bfloat16)])
def test_non_expert_tensors_equal_from_pretrained(checkpoints: dict[str, Path], family: str,
                                                  dtype: torch.dtype) -> None:
    """As from_pretrained, value for value and dtype for dtype (DeepSeek's e_score_correction_bias
    stays float32 under bf16); the experts are left unread."""
    model, report = load_without_experts(checkpoints[family], "cpu", dtype)
    if family == "deepseek_v3":
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.dtype == torch.float32 and bool(bias.abs().sum() > 0)
    _assert_like_reference(model, _reference(checkpoints[family], dtype), torch.device("cpu"))
    assert report.skipped_expert_tensors == sum(1 for name in _header_bytes(checkpoints[family]) if EXPERTS in name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_loads_onto_the_gpu_like_from_pretrained(checkpoints: dict[str, Path], family: str) -> None:
    """Straight onto the GPU in bf16 (each tensor through one host buffer): the same as
    ``from_pretrained(dtype=bf16).to("cuda")``."""
    model, report = load_without_experts(checkpoints[family], "cuda", torch.bfloat16)
    _assert_like_reference(model, _reference(checkpoints[family], torch.bfloat16).to("cuda"),
                           torch.device("cuda", torch.cuda.current_device()))
    assert report.bytes_read == sum(size for name, size in _header_bytes(checkpoints[family]).items()
                                    if EXPERTS not in name)


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    """With tie_word_embeddings save_pretrained writes only the embedding; lm_head is that very
    parameter, read once."""
    path = _write("qwen3_moe", tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in _header_bytes(path)
    model, report = load_without_experts(path, "cpu", torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, _reference(path, torch.float32).lm_head.weight)
    assert report.tensors_read == sum(1 for name in _header_bytes(path) if EXPERTS not in name)


# ---------------------------------------------------------------------------------------------
# What is read
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_an_ep_rank_reads_its_resident_experts_and_the_rest_only(checkpoints: dict[str, Path], family: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What a serving rank reads at start (rank 1 of 2: ``EPExperts.from_checkpoint`` then the model
    without experts), counted at the checkpoint reader's one read call: exactly the non-expert bytes plus
    the bytes of this rank's resident experts, none of the other rank's."""
    import re

    from vexpert_runtime.model import checkpoint
    from vexpert_runtime.model.ep_moe import base_experts
    from vexpert_runtime.serve.hf_model import HFStepModel
    from vexpert_runtime.serve.moe_executors import EPExperts, checkpoint_reader

    path = checkpoints[family]
    sizes = _header_bytes(path)
    read: dict[str, int] = {}
    original = checkpoint._read_bytes

    def counting(file: Path, stored: Any, name: str, out: torch.Tensor) -> None:
        read[name] = read.get(name, 0) + stored.end - stored.start
        original(file, stored, name, out)

    monkeypatch.setattr(checkpoint, "_read_bytes", counting)
    reader = checkpoint_reader(path)
    executor = EPExperts.from_checkpoint(reader, reader.spec.num_layers, torch.float32, 1, 2, None, "cpu")
    model = HFStepModel(path, dtype=torch.float32, load_experts=False, executor=executor, kv_cache_tokens=64)
    mine = set(base_experts(reader.spec.num_experts, 2, 1))
    expert_name = re.compile(r"\.mlp\.experts\.(\d+)\.")
    resident = {name: size for name, size in sizes.items()
                if (m := expert_name.search(name)) is not None and int(m.group(1)) in mine}
    assert read == resident and resident  # the expert reads: this rank's, each once
    non_expert = sum(size for name, size in sizes.items() if EXPERTS not in name)
    assert model.load_report.bytes_read == non_expert
    total = sum(sizes.values())
    assert non_expert + sum(resident.values()) < total - sum(resident.values()) // 2  # the other half stayed unread


@pytest.mark.parametrize("family", FAMILIES)
def test_reads_only_the_non_expert_bytes(checkpoints: dict[str, Path], family: str) -> None:
    path = checkpoints[family]
    sizes = _header_bytes(path)
    non_expert = {name: size for name, size in sizes.items() if EXPERTS not in name}
    expert_bytes = sum(size for name, size in sizes.items() if EXPERTS in name)
    _, report = load_without_experts(path, "cpu", torch.float32)
    assert report == LoadReport(tensors_read=len(non_expert), bytes_read=sum(non_expert.values()),
                                skipped_expert_tensors=len(sizes) - len(non_expert))
    file_bytes = sum(shard.stat().st_size for shard in path.glob("*.safetensors"))
    assert expert_bytes > 0 and file_bytes - report.bytes_read >= expert_bytes


def test_block_fp8_weights_are_dequantised(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A DeepSeek-style block-FP8 checkpoint (non-expert projections F8_E4M3 + F32 weight_scale_inv):
    from_config builds plain Linear layers, which get the dequantised weights; the scales count as
    read bytes. Without the config's quantization_config the FP8 tensors are refused."""
    block = (16, 16)
    quantised: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def quantise(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for name, weight in tensors.items():
            if name.endswith("_proj.weight") and EXPERTS not in name:
                quantised[name] = quantize_fp8_block(weight, block)
                out[name], out[name + "_scale_inv"] = quantised[name]
        return out

    path = _rewrite(checkpoints["deepseek_v3"], tmp_path / "fp8", quantise)
    assert any("self_attn" in name for name in quantised) and any("shared_experts" in name for name in quantised)
    with pytest.raises(VExpertInputError, match=r"F8_E4M3 in the checkpoint, but config.json declares no block-FP8"):
        load_without_experts(path, "cpu", torch.float32)

    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                     "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    model, report = load_without_experts(path, "cpu", torch.float32)
    reference = _tensors(_reference(checkpoints["deepseek_v3"], torch.float32))
    for name, tensor in _tensors(model).items():
        if EXPERTS in name:
            continue
        want = dequantize_fp8_block(*quantised[name], block, torch.float32) if name in quantised else reference[name]
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want), name
    sizes = _header_bytes(path)
    assert report.bytes_read == sum(size for name, size in sizes.items() if EXPERTS not in name)

    # model.linear_format fp8_block: the bias-free FP8 linears stay FP8 as stored (MLA's kv_b_proj, absorbed into the
    # query and output as a matrix, is dequantised), the same bytes read, ~a quarter of their fp32 bytes kept, and
    # each computes what its dequantised weight does
    kept, kept_report = load_without_experts(path, "cpu", torch.float32, fp8_linears=True)
    assert kept_report.bytes_read == report.bytes_read
    fp8 = {name: module for name, module in kept.named_modules() if isinstance(module, Fp8Linear)}
    assert fp8 and all(name + ".weight" in quantised for name in fp8)
    assert {name for name in quantised if name.removesuffix(".weight") not in fp8} == \
        {name for name in quantised if "kv_b_proj" in name}
    for name, module in fp8.items():
        weight, scales = quantised[name + ".weight"]
        assert torch.equal(module.weight, weight) and torch.equal(module.weight_scale_inv, scales)
        x = torch.randn(3, module.in_features)
        assert torch.equal(module(x), x @ dequantize_fp8_block(weight, scales, block, torch.float32).T), name

    # ... multiplied against FP8 activations under model.expert_compute w8a8 (the CPU emulation of W8A8)
    from vexpert_runtime.model.fp8_activations import fp8_activation_round_trip

    w8a8, _ = load_without_experts(path, "cpu", torch.float32, fp8_linears=True, fp8_activations=True)
    w8a8_linears = {name: module for name, module in w8a8.named_modules() if isinstance(module, Fp8Linear)}
    assert w8a8_linears.keys() == fp8.keys() and all(m.fp8_activations for m in w8a8_linears.values())
    assert not any(m.fp8_activations for m in fp8.values())
    for name, module in w8a8_linears.items():
        weight, scales = quantised[name + ".weight"]
        x = torch.randn(3, module.in_features)
        dense = dequantize_fp8_block(weight, scales, block, torch.float32)
        assert torch.equal(module(x), fp8_activation_round_trip(x, block[1]) @ dense.T), name

    def stored_bytes(m: Any) -> int:
        return sum(t.numel() * t.element_size() for n, t in [*m.named_parameters(), *m.named_buffers()]
                   if EXPERTS not in n and t.device.type != "meta")

    linear_fp32 = sum(quantised[name + ".weight"][0].numel() * 4 for name in fp8)
    assert stored_bytes(model) - stored_bytes(kept) > 0.7 * linear_fp32  # fp8 + scales instead of fp32


# ---------------------------------------------------------------------------------------------
# Bad checkpoints: one clear error, nothing read
# ---------------------------------------------------------------------------------------------


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The checkpoint tensors the loader reads from now on (its one read call site)."""
    reads: list[str] = []
    original = model_loading._TensorReader.read

    def read(self: Any, key: str) -> torch.Tensor:
        reads.append(key)
        return original(self, key)

    monkeypatch.setattr(model_loading._TensorReader, "read", read)
    return reads


@pytest.mark.parametrize(("family", "tensor"), [
    ("qwen3_moe", "model.layers.1.self_attn.o_proj.weight"),
    ("qwen2_moe", "model.layers.2.mlp.shared_expert_gate.weight"),
    ("deepseek_v3", "model.layers.2.mlp.gate.e_score_correction_bias"),  # a persistent buffer
    ("deepseek_v3", "lm_head.weight"),
])
def test_missing_tensor_is_named_before_anything_is_read(checkpoints: dict[str, Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, family: str,
                                                         tensor: str) -> None:
    path = _rewrite(checkpoints[family], tmp_path / "broken",
                    lambda tensors: {name: t for name, t in tensors.items() if name != tensor})
    reads = _record_reads(monkeypatch)
    with pytest.raises(VExpertInputError, match=rf"{tensor}: missing from") as caught:
        load_without_experts(path, "cpu", torch.float32)
    assert caught.value.field == "model.checkpoint_path" and caught.value.fix
    assert reads == []


def test_wrong_shape_is_named_before_anything_is_read(checkpoints: dict[str, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def widen(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**tensors, "model.norm.weight": torch.ones(65)}

    path = _rewrite(checkpoints["qwen3_moe"], tmp_path / "wide", widen)
    reads = _record_reads(monkeypatch)
    with pytest.raises(VExpertInputError, match=r"model\.norm\.weight: shape \[65\] in the checkpoint.*\[64\]"):
        load_without_experts(path, "cpu", torch.float32)
    assert reads == []


# ---------------------------------------------------------------------------------------------
# Peak memory of a rank's start on an expert-heavy checkpoint
# ---------------------------------------------------------------------------------------------

# Qwen3-MoE, 16 layers × 48 experts of 3·256·512 float32 (1.5 MiB each): 1.13 GiB of experts, 31 MiB
# of everything else (experts 97% of the bytes).
BIG = {"vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
       "num_hidden_layers": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "num_experts": 48, "num_experts_per_tok": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}


def _write_expert_heavy(path: Path) -> None:
    """The checkpoint with save_pretrained's tensor names, written shard by shard (one per layer's
    experts) without ever building the model: non-expert names and shapes from the model on meta,
    expert names ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``."""
    from safetensors.torch import save_file

    config = transformers.Qwen3MoeConfig(**BIG)
    config.save_pretrained(path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}

    def shard(file: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))

    shard("model-dense.safetensors", {name: 0.02 * torch.randn(t.shape, generator=generator)
                                      for name, t in meta.state_dict().items() if EXPERTS not in name})
    hidden, inter = BIG["hidden_size"], BIG["moe_intermediate_size"]
    for layer in range(BIG["num_hidden_layers"]):
        shard(f"model-experts-{layer:02d}.safetensors",
              {expert_tensor(layer, e, p): torch.full(projection_shape(p, inter, hidden), 0.01 * (e + 1))
               for e in range(BIG["num_experts"]) for p in PROJECTIONS})
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# Runs in a fresh interpreter. The baseline is the RSS once torch, transformers and the model's code
# are imported (code, not weights). Peaks are the process's VmHWM, not getrusage's ru_maxrss: a child
# of a big process (pytest) inherits its parent's peak there (Linux keeps the old address space's
# high-water mark across the exec), so ru_maxrss would report pytest's peak, not the child's.
# CheckpointReader keeps its shards memory-mapped and the pages it touched count as RSS while it
# lives, and CheckpointReader.experts stacks a list of rows (a second copy of them): so the rank's
# experts are read one at a time, each by a reader dropped right after, into the layer's resident
# block — as a rank copying each expert straight to device memory would hold them.
_CHILD = r"""
import json, sys
import torch, transformers
import transformers.models.qwen3_moe.modeling_qwen3_moe
from vexpert_runtime.model.checkpoint import CheckpointReader, read_model_spec
from vexpert_runtime.model.ep_moe import base_experts
from vexpert_runtime.serve.model_loading import load_without_experts

def status(key):  # bytes
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key + ":"))

try:  # the peak so far (imports) becomes the current RSS
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
except OSError:
    pass  # then the baseline's import peak only makes the numbers larger
path = sys.argv[1]
base = status("VmRSS")
model, report = load_without_experts(path, "cpu", torch.float32)
# The CPU weights are views of the mapped shards (as from_pretrained's): touch every one, as a
# forward pass would, so that their pages are resident and counted.
touched = sum(float(t.sum()) for t in [*model.parameters(), *model.buffers()] if not t.is_meta)
loaded = status("VmHWM")
spec = read_model_spec(path)
mine = base_experts(spec.num_experts, 2, 0)
resident = []
for layer in range(spec.num_layers):
    rows = torch.empty(len(mine), spec.expert_numel, dtype=torch.float32)
    for i, expert in enumerate(mine):
        reader = CheckpointReader(path, spec)
        rows[i] = reader.expert(layer, expert, torch.float32)
        del reader
    resident.append(rows)
print(json.dumps({"load": loaded - base, "total": status("VmHWM") - base, "bytes_read": report.bytes_read,
                  "resident": sum(r.numel() * r.element_size() for r in resident),
                  "on_meta": sum(p.numel() for p in model.parameters() if p.is_meta)}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmRSS/VmHWM from /proc")
def test_rank_start_peak_rss_is_its_share_not_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "expert_heavy"
    path.mkdir()
    try:
        _write_expert_heavy(path)
        sizes = _header_bytes(path)
        file_bytes = sum(shard.stat().st_size for shard in path.glob("*.safetensors"))
        expert_bytes = sum(size for name, size in sizes.items() if EXPERTS in name)
        non_expert = file_bytes - expert_bytes
        assert 1.0e9 < file_bytes < 1.6e9 and expert_bytes > 0.85 * file_bytes
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True,
                              timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(path, ignore_errors=True)
    mib = 2**20
    print(f"checkpoint {file_bytes / mib:.0f} MiB (experts {expert_bytes / mib:.0f}), read {got['bytes_read'] / mib:.1f}"
          f" MiB; peak RSS over baseline: load {got['load'] / mib:.1f} MiB, with rank 0/2's experts "
          f"({got['resident'] / mib:.0f} MiB) {got['total'] / mib:.0f} MiB = {got['total'] / file_bytes:.3f} × checkpoint")
    assert got["bytes_read"] == sum(size for name, size in sizes.items() if EXPERTS not in name)
    assert got["on_meta"] > 0 and got["resident"] * 2 == expert_bytes
    # The load itself holds about the non-expert weights (plus the model's Python objects)...
    assert got["load"] < got["bytes_read"] + 40 * mib
    # ...and with this rank's half of the experts the process stays far from the whole checkpoint.
    assert got["total"] < 0.6 * file_bytes
    assert non_expert < 0.05 * file_bytes


def test_nonexpert_bytes_counts_a_deepseek_v3_rank_with_the_loaders_rule() -> None:
    """benchmarks/nonexpert_bytes.py (DeepSeek-V3 on the meta device): its FP8 linears are the bias-free ``*_proj``
    layers but ``kv_b_proj`` (MLA's q/kv/o projections, shared experts, dense MLPs), and FP8 saves a byte per weight
    less the scales."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "nonexpert_bytes.py")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(repo / "runtime")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout)
    hidden, layers, dense_layers, q_lora, kv_lora, heads = 7168, 61, 3, 1536, 512, 128
    mla = hidden * q_lora + q_lora * heads * 192 + hidden * (kv_lora + 64) + heads * 128 * hidden  # no kv_b_proj
    mlps = dense_layers * 3 * hidden * 18432 + (layers - dense_layers) * 3 * hidden * 2048  # dense + shared experts
    assert row["fp8_linear_params"] == layers * mla + mlps
    saved = row["fp8_linear_weights"] - row["fp8_linear_scales"]  # 2 bytes → 1, plus the scales
    assert abs(row["saved_gb"] - saved / 1e9) < 0.01 and 13 < row["saved_gb"] < 15
