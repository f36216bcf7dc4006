"""Checkpoint loading (DeepSeek-V3 and Qwen-MoE naming), validation errors, the L2 pool and the
routing gates against plain per-token oracles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.checkpoint import (
    CheckpointReader,
    MoESpec,
    correction_bias_tensor,
    expert_tensor,
    random_weights,
    read_model_spec,
    router_tensor,
    shared_gate_tensor,
    shared_tensor,
    write_checkpoint,
    write_tiny_checkpoint,
)
from vexpert_runtime.model.families import DEEPSEEK, QWEN
from vexpert_runtime.model.routing import deepseek_v3_topk, route, softmax_topk
from vexpert_runtime.model.weights import unpack_expert
from vexpert_runtime.node.expert_pool import ExpertPool, hottest_experts

DS = MoESpec(
    architecture=DEEPSEEK,
    hidden_size=16,
    intermediate_size=8,
    num_experts=8,
    top_k=3,
    moe_layers=(1, 2),
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    correction_bias=True,
    shared_intermediate_size=16,
)
QW = MoESpec(
    architecture=QWEN,
    hidden_size=16,
    intermediate_size=8,
    num_experts=6,
    top_k=2,
    moe_layers=(0, 1),
    scoring="softmax",
    norm_topk_prob=False,
    shared_intermediate_size=12,
    shared_expert_gate=True,
)


@pytest.mark.parametrize("spec", [DS, QW], ids=["deepseek_v3", "qwen2_moe"])
def test_round_trip_reads_every_tensor_exactly(tmp_path: Path, spec: MoESpec) -> None:
    weights = random_weights(spec, seed=3)
    write_checkpoint(tmp_path, spec, weights, shards=3)
    assert read_model_spec(tmp_path) == spec
    reader = CheckpointReader(tmp_path, spec)
    reader.validate()
    layer = spec.moe_layers[1]
    row = reader.expert(1, 5, torch.float32)
    gate, up, down = unpack_expert(row, spec.intermediate_size, spec.hidden_size)
    assert torch.equal(gate, weights[expert_tensor(layer, 5, "gate")])
    assert torch.equal(up, weights[expert_tensor(layer, 5, "up")])
    assert torch.equal(down, weights[expert_tensor(layer, 5, "down")])
    router = reader.router(1)
    assert torch.equal(router.weight, weights[router_tensor(layer)])
    shared = reader.shared(1, torch.float32)
    assert shared is not None
    assert torch.equal(shared.down, weights[shared_tensor(spec, layer, "down")])
    if spec.architecture == DEEPSEEK:
        assert router.correction_bias is not None
        assert torch.equal(router.correction_bias, weights[correction_bias_tensor(layer)])
        assert shared.output_gate is None
    else:
        assert router.correction_bias is None
        assert shared.output_gate is not None
        assert torch.equal(shared.output_gate, weights[shared_gate_tensor(layer)])


def test_reads_shards_without_an_index(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, DS, shards=2)
    (tmp_path / "model.safetensors.index.json").unlink()
    reader = CheckpointReader(tmp_path, read_model_spec(tmp_path))
    reader.validate()
    assert reader.experts(0, [0, 7], torch.float32).shape == (2, DS.expert_numel)


def _rewrite(path: Path, name: str, value: torch.Tensor | None) -> None:
    """Replace (or drop, value=None) one tensor in whichever shard holds it."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"][name]
    tensors = load_file(str(shard))
    if value is None:
        del tensors[name]
        del index["weight_map"][name]
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[name] = value
    save_file(tensors, str(shard))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, DS)
    name = expert_tensor(2, 6, "up")
    _rewrite(tmp_path, name, None)
    with pytest.raises(VExpertInputError, match=r"tensor model\.layers\.2\.mlp\.experts\.6\.up_proj\.weight is missing"):
        CheckpointReader(tmp_path, DS).validate()


def test_mismatched_shape_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, DS)
    _rewrite(tmp_path, expert_tensor(1, 0, "down"), torch.zeros(16, 9))
    with pytest.raises(VExpertInputError, match=r"down_proj\.weight .* has shape \[16, 9\], config\.json implies \[16, 8\]"):
        CheckpointReader(tmp_path, DS).validate()


def test_missing_correction_bias_is_named(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, DS)
    _rewrite(tmp_path, correction_bias_tensor(1), None)
    with pytest.raises(VExpertInputError, match="e_score_correction_bias is missing"):
        CheckpointReader(tmp_path, DS).validate()


def test_fp8_weights_without_their_quantization_config_are_refused(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, DS)
    _rewrite(tmp_path, expert_tensor(1, 1, "gate"), torch.zeros(8, 16).to(torch.float8_e4m3fn))
    with pytest.raises(VExpertInputError, match=r"experts\.1\.gate_proj\.weight .* is F8_E4M3, but config\.json has no FP8"):
        CheckpointReader(tmp_path, DS).validate()


def test_integer_weights_are_refused(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, DS)
    _rewrite(tmp_path, expert_tensor(1, 1, "gate"), torch.zeros(8, 16, dtype=torch.int8))
    with pytest.raises(VExpertInputError, match="only F32/F16/BF16"):
        CheckpointReader(tmp_path, DS).validate()


def test_config_problems(tmp_path: Path) -> None:
    with pytest.raises(VExpertInputError, match=r"config\.json not found"):
        read_model_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(VExpertInputError, match="'llama' is not a supported MoE family"):
        read_model_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 4}))
    with pytest.raises(VExpertInputError, match="n_routed_experts: must be a positive integer"):
        read_model_spec(tmp_path)


def test_moe_layer_selection_from_config() -> None:
    from vexpert_runtime.model.checkpoint import spec_from_config

    base = {"hidden_size": 8, "moe_intermediate_size": 4, "num_experts_per_tok": 2, "num_hidden_layers": 61}
    ds = spec_from_config({**base, "model_type": "deepseek_v3", "n_routed_experts": 256, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "n_shared_experts": 1})
    assert ds.moe_layers == tuple(range(3, 61)) and ds.num_layers == 58  # DeepSeek-V3: 58 MoE layers
    assert ds.correction_bias and ds.shared_intermediate_size == 4
    qw = spec_from_config({**base, "model_type": "qwen3_moe", "num_experts": 128, "num_hidden_layers": 6, "mlp_only_layers": [0, 5]})
    assert qw.moe_layers == (1, 2, 3, 4) and qw.norm_topk_prob and qw.shared_intermediate_size == 0


def test_pool_keeps_hottest_and_refresh_shares_unchanged_layers(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, DS)
    reader = CheckpointReader(tmp_path, DS)
    load = lambda layer, experts: reader.experts(layer, experts, torch.float32)  # noqa: E731
    alloc = lambda rows, numel: torch.empty(rows, numel)  # noqa: E731
    hot = torch.tensor([[5.0, 0, 9, 1, 9, 0, 0, 3], [0, 1, 2, 3, 4, 5, 6, 7]])
    experts = hottest_experts(hot, 3)
    assert experts.tolist() == [[0, 2, 4], [5, 6, 7]]  # ties at 9 both kept; sorted ids
    pool = ExpertPool.build(experts, 8, DS.expert_numel, load, alloc)
    assert pool.nbytes == 2 * 3 * DS.expert_numel * 4
    assert pool.pooled_mask().sum().item() == 6
    assert torch.equal(pool.row(0, 4), reader.expert(0, 4, torch.float32))
    with pytest.raises(KeyError):
        pool.row(0, 1)
    new = pool.refreshed(torch.tensor([[0, 2, 4], [1, 6, 7]]), load, alloc)
    assert new.buffers[0] is pool.buffers[0]  # unchanged layer shares its buffer
    assert new.buffers[1] is not pool.buffers[1]
    assert torch.equal(new.row(1, 1), reader.expert(1, 1, torch.float32))
    assert torch.equal(new.row(1, 7), pool.row(1, 7))
    assert torch.equal(pool.row(1, 5), reader.expert(1, 5, torch.float32))  # the old snapshot is intact


# ------------------------------------------------------------------------------------------------
# Routing against per-token oracles
# ------------------------------------------------------------------------------------------------


def _deepseek_oracle(logits: torch.Tensor, bias: torch.Tensor, spec: MoESpec) -> tuple[list[set[int]], torch.Tensor]:
    """DeepSeek-V3 noaux_tc routing written token by token from the model card's description."""
    per_group = spec.num_experts // spec.n_group
    chosen, weights = [], []
    for row in logits.double():
        score = torch.sigmoid(row)
        biased = score + bias.double()
        groups = sorted(
            range(spec.n_group),
            key=lambda g: -sum(sorted(biased[g * per_group : (g + 1) * per_group].tolist(), reverse=True)[:2]),
        )[: spec.topk_group]
        allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        top = sorted(allowed, key=lambda e: -biased[e].item())[: spec.top_k]
        w = torch.stack([score[e] for e in top])
        w = w / w.sum() * spec.routed_scaling_factor
        chosen.append(set(top))
        weights.append(sorted(w.tolist(), reverse=True))
    return chosen, torch.tensor(weights, dtype=torch.float64)


def test_deepseek_routing_matches_per_token_oracle() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(200, DS.num_experts, generator=gen) * 2
    bias = torch.randn(DS.num_experts, generator=gen) * 0.3
    ids, weights = deepseek_v3_topk(logits, bias, DS.top_k, DS.n_group, DS.topk_group, DS.routed_scaling_factor, True)
    chosen, oracle_w = _deepseek_oracle(logits, bias, DS)
    assert [set(r) for r in ids.tolist()] == chosen
    got = torch.sort(weights.double(), dim=1, descending=True).values
    assert torch.allclose(got, oracle_w, atol=1e-6)
    # group limit: the experts of a token span at most topk_group groups
    assert max(len({e // 2 for e in r}) for r in ids.tolist()) <= DS.topk_group


def test_softmax_routing_matches_oracle() -> None:
    logits = torch.randn(50, 6, generator=torch.Generator().manual_seed(1))
    ids, weights = softmax_topk(logits, 2, norm_topk_prob=False)
    probs = logits.softmax(-1)
    for row in range(50):
        order = probs[row].argsort(descending=True)[:2]
        assert ids[row].tolist() == order.tolist()
        assert torch.allclose(weights[row], probs[row, order])
    _, normed = softmax_topk(logits, 2, norm_topk_prob=True)
    assert torch.allclose(normed.sum(-1), torch.ones(50))


def test_route_dispatches_on_spec_and_logit_bias_skews(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, QW)
    router = CheckpointReader(tmp_path, QW).router(0)
    x = torch.randn(300, QW.hidden_size, generator=torch.Generator().manual_seed(2))
    ids, weights = route(x, router, QW)
    assert ids.shape == (300, 2) and bool((weights > 0).all())
    skew = torch.tensor([4.0, 0, 0, 0, 0, 0])
    ids_skewed, _ = route(x, router, QW, skew)
    assert (ids_skewed == 0).sum() > 2 * (ids == 0).sum()
