"""HFStepModel (issue #13): transformers MoE models run step by step, experts local or expert-parallel.

Tiny random DeepSeek-V3 (MLA), Qwen3-MoE and Qwen2-MoE checkpoints are written with ``save_pretrained``;
the step model's greedy tokens must equal the unmodified model's ``generate(do_sample=False)`` in
float32, with sequences joining and leaving a batch and prompts fed in chunks, on one rank with
:class:`LocalExperts` and on two gloo ranks with :class:`EPExperts` whose routing table puts copies of
hot experts into slots on the other rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from serve_support import block_fp8_copies  # noqa: E402
from vexpert_runtime.model.checkpoint import read_model_spec  # noqa: E402
from vexpert_runtime.serve.hf_model import HFStepModel  # noqa: E402
from vexpert_runtime.serve.kv_cache import BlockPool  # noqa: E402
from vexpert_runtime.serve.moe_executors import LocalExperts, checkpoint_reader  # noqa: E402
from vexpert_runtime.serve.step import SamplingSpec, SequenceWork  # noqa: E402

FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe")
# Prompts of different lengths; the second joins one step late, the third three steps late.
PROMPTS = ([5, 9, 17], [40, 2, 7, 8, 61, 33, 12, 90, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24])
JOINS = (0, 1, 3)
NEW_TOKENS = (6, 4, 5)
CHUNK = 4  # prompt tokens fed per step: the longer prompts are prefilled in chunks
KV_TOKENS = 512  # KV-cache tokens of a test model (32 blocks of 16)


def _config(family: str) -> Any:
    """A tiny config of ``family``: 3 layers (DeepSeek: the first dense), 8 experts, top-2, no EOS
    (so generation never stops early), weights large enough that tokens and routing vary."""
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_experts_per_tok": 2,
              "max_position_embeddings": 128, "initializer_range": 0.15, "eos_token_id": None,
              "bos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
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


def _write(family: str, path: Path) -> Path:
    torch.manual_seed(FAMILIES.index(family))
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    if family == "deepseek_v3":  # a non-zero correction bias, so the router's noaux_tc path matters
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: _write(family, root / family) for family in FAMILIES}


def _reference(path: Path, prompts: Sequence[Sequence[int]] = PROMPTS,
               new_tokens: Sequence[int] = NEW_TOKENS) -> tuple[list[list[int]], list[dict[int, int]]]:
    """The unmodified model's greedy tokens per prompt (``generate``, one prompt at a time), and how
    often each MoE layer's router picked each expert (from hooks on the routers)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    counts: list[dict[int, int]] = [{} for _ in routers]

    def hook(index: int) -> Callable[..., None]:
        def count(_module: Any, _args: Any, output: Any) -> None:
            for expert in output[2].reshape(-1).tolist():
                counts[index][expert] = counts[index].get(expert, 0) + 1
        return count

    for index, router in enumerate(routers):
        router.register_forward_hook(hook(index))
    out = []
    for prompt, new in zip(prompts, new_tokens, strict=True):
        ids = torch.tensor([list(prompt)])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                   eos_token_id=None, pad_token_id=0)
        out.append(generated[0, len(prompt):].tolist())
        assert len(out[-1]) == new
    return out, counts


def drive(model: HFStepModel, prompts: Sequence[Sequence[int]], new_tokens: Sequence[int], joins: Sequence[int],
          chunk: int, more: Callable[[bool], bool] = lambda local: local, seq_base: int = 0,
          sampling: SamplingSpec | Sequence[SamplingSpec | None] | None = None,
          logprobs: list[list[tuple[float, list[float], list[int]]]] | None = None) -> list[list[int]]:
    """A tiny continuous-batching driver: prompt i joins at step joins[i], is fed ``chunk`` tokens a
    step, then decodes (greedily, or with ``sampling``, seeded seed + i) until it has new_tokens[i]
    tokens and leaves (its blocks freed, so later sequences reuse them). ``more(local_has_work)``
    decides whether to run another step (the EP ranks' lockstep); ``sampling`` may be one per prompt.
    ``logprobs`` (with a ``sampling``
    that asks for them): per prompt, each sampled token's (log-probability, top log-probabilities, top ids)."""
    pool = BlockPool(model.kv_num_blocks, model.kv_block_size)
    fed = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    step = 0
    while more(any(len(o) < n for o, n in zip(out, new_tokens, strict=True))):
        work = []
        for i, prompt in enumerate(prompts):
            if joins[i] > step or len(out[i]) == new_tokens[i]:
                continue
            if not pool.holds(seq_base + i):
                pool.add(seq_base + i)
            tokens = prompt[fed[i]:fed[i] + chunk] if fed[i] < len(prompt) else [out[i][-1]]
            blocks = pool.grow(seq_base + i, fed[i] + len(tokens))
            chosen = sampling[i] if isinstance(sampling, list | tuple) else sampling
            spec = SamplingSpec() if chosen is None else dataclasses.replace(chosen, seed=chosen.seed + i)
            sample = dataclasses.replace(spec, draw=len(out[i])) if fed[i] + len(tokens) >= len(prompt) else None
            penalized = (spec.repetition, spec.presence, spec.frequency) != (1.0, 0.0, 0.0) or bool(spec.logit_bias)
            work.append(SequenceWork(seq_base + i, tuple(tokens), fed[i], tuple(blocks), sample,
                                     penalty_prompt_len=len(prompt) if penalized else -1))
            fed[i] += len(tokens)
        pending = model.launch(work)
        sampled = pending.result()
        step_logprobs = pending.logprobs()
        assert sampled.shape == (len(work),) and sampled.dtype == torch.int64
        for row, (token, item) in enumerate(zip(sampled.tolist(), work, strict=True)):
            i = item.seq_id - seq_base
            if item.sample is None:
                assert token == -1
                continue
            out[i].append(token)
            if logprobs is not None:
                assert step_logprobs is not None
                logprobs[i].append((float(step_logprobs.sampled[row]), step_logprobs.top_logprobs[row].tolist(),
                                    step_logprobs.top_ids[row].tolist()))
            if len(out[i]) == new_tokens[i]:
                model.release(item.seq_id)
                pool.free(item.seq_id)
        step += 1
    return out


# ---------------------------------------------------------------------------------------------
# One rank, the model's own experts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_local_experts_match_generate(checkpoints: dict[str, Path], family: str) -> None:
    expected, _ = _reference(checkpoints[family])
    model = HFStepModel(checkpoints[family], dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    assert isinstance(model.executor, LocalExperts)
    assert drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK) == expected
    assert len({t for seq in expected for t in seq}) > 3  # the tokens vary: the comparison means something


@pytest.mark.parametrize("family", FAMILIES)
def test_rank_local_model_matches_generate(checkpoints: dict[str, Path], family: str) -> None:
    """Loaded without its routed experts (they stay on meta), the rank's experts read from the
    shards: the same greedy tokens as transformers' generate."""
    from vexpert_runtime.serve.moe_executors import EPExperts

    expected, _ = _reference(checkpoints[family])
    reader = checkpoint_reader(checkpoints[family])
    executor = EPExperts.from_checkpoint(reader, reader.spec.num_layers, torch.float32, 0, 1, None, "cpu")
    model = HFStepModel(checkpoints[family], dtype=torch.float32, kv_cache_tokens=KV_TOKENS, load_experts=False,
                        executor=executor)
    assert all(e is None for e in model.experts) and model.load_report.bytes_read > 0
    assert drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK) == expected


def test_a_block_fp8_checkpoint_serves_the_tokens_of_its_dequantised_weights(checkpoints: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """DeepSeek-V3's own format: the rank keeps its experts as FP8 rows (half the bytes), read as such
    by the EP layer, the rest dequantised at load — the same greedy tokens as transformers' generate
    over the dequantised weights. (Until 2026-12-06 the rank read FP8 rows but computed them as dense
    ones: a DeepSeek-V3-format checkpoint failed at its first MoE layer.)"""
    from vexpert_runtime.serve.moe_executors import EPExperts

    fp8, dequantised = block_fp8_copies(checkpoints["deepseek_v3"], tmp_path)
    expected, _ = _reference(dequantised)
    reader = checkpoint_reader(fp8)
    executor = EPExperts.from_checkpoint(reader, reader.spec.num_layers, torch.float32, 0, 1, None, "cpu")
    assert executor.format is not None and executor.format.fp8_block == (16, 16)
    assert all(isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8 for rows in executor.resident)
    model = HFStepModel(fp8, dtype=torch.float32, kv_cache_tokens=KV_TOKENS, load_experts=False, executor=executor)
    assert drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK) == expected
    assert len({t for seq in expected for t in seq}) > 3


@pytest.mark.parametrize(("family", "windows"), [
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 4,
                   "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4}),  # no layer_types: every layer
])
def test_sliding_window_layers_match_generate(tmp_path: Path, family: str, windows: dict[str, Any]) -> None:
    """Sliding-window layers (a 4-token window, prompts of 3–14 tokens in chunks of 4): the batched
    path's tokens equal generate's, and differ from the same weights' tokens without the window (so
    the window is what was compared)."""
    torch.manual_seed(3)
    config = _config(family)
    plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.save_pretrained(tmp_path / "plain")
    for key, value in windows.items():
        setattr(config, key, value)
    windowed = transformers.AutoModelForCausalLM.from_config(config)
    windowed.load_state_dict(plain.state_dict())
    windowed.save_pretrained(tmp_path / "windowed")
    expected, _ = _reference(tmp_path / "windowed")
    assert expected != _reference(tmp_path / "plain")[0]
    model = HFStepModel(tmp_path / "windowed", dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    assert model.windows == [4 if t == "sliding_attention" else None for t in windows.get("layer_types", ["sliding_attention"] * 3)]
    assert drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_are_the_log_softmax_of_transformers_logits(checkpoints: dict[str, Path], family: str) -> None:
    """Sampled at temperature 1.3 through the batched step (joins, chunked prompts), each token's
    log-probability and the 20 most likely tokens' equal the log-softmax of transformers' own logits at
    that position over the sequence so far — the model's distribution, not the tempered one, as vLLM's
    default; a step where no row asks reports none."""
    model = HFStepModel(checkpoints[family], dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    collected: list[list[tuple[float, list[float], list[int]]]] = [[] for _ in PROMPTS]
    spec = SamplingSpec(temperature=1.3, seed=7, logprobs=True)
    tokens = drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, sampling=spec, logprobs=collected)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints[family]), local_files_only=True,
                                                                  dtype=torch.float32)
    for prompt, out, entries in zip(PROMPTS, tokens, collected, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([[*prompt, *out]])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)  # [new tokens, V]
        assert len(entries) == len(out)
        for position, (token, (sampled, top, top_ids)) in enumerate(zip(out, entries, strict=True)):
            assert sampled == pytest.approx(float(expected[position, token]), abs=1e-4)
            want, want_ids = expected[position].topk(20)
            assert top == pytest.approx(want.tolist(), abs=1e-4)
            assert top_ids == want_ids.tolist()
    assert len({t for seq in tokens for t in seq}) > 3  # sampled tokens vary
    pool = BlockPool(model.kv_num_blocks, model.kv_block_size)
    pool.add(0)
    plain = model.launch([SequenceWork(0, (3, 4), 0, tuple(pool.grow(0, 2)), SamplingSpec(temperature=1.3))])
    assert plain.result().shape == (1,) and plain.logprobs() is None


def _penalized_greedy(path: Path, prompt: Sequence[int], new: int, repetition: float, presence: float,
                      frequency: float, bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding with a logit bias and vLLM's penalties, written out token by token over transformers'
    logits: the bias added; a token of prompt or output has its logit divided by ``repetition`` where
    positive, multiplied where not; then each output token's logit loses frequency × its count + presence."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    sequence, out = list(prompt), []
    for _ in range(new):
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0, -1].float()
        for token, value in (bias or {}).items():
            logits[token] += value
        for token in set(sequence):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
        sequence.append(out[-1])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_penalties_equal_vllms_formula_with_joins_chunks_and_reused_rows(checkpoints: dict[str, Path],
                                                                         family: str) -> None:
    """Greedy with repetition, presence and frequency penalties through the batched step (sequences joining
    and leaving, prompts in chunks; then a second batch on the same model, whose sequences take the rows
    the first freed): the tokens of the penalties' definition, decoded one by one over transformers'
    logits; an unpenalized sequence in the same batches decodes as without penalties."""
    model = HFStepModel(checkpoints[family], dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    plain = _reference(checkpoints[family])[0]
    for base, (repetition, presence, frequency) in ((0, (1.6, 0.0, 0.0)), (20, (1.0, 0.7, 0.9))):
        spec = SamplingSpec(repetition=repetition, presence=presence, frequency=frequency)
        expected = [_penalized_greedy(checkpoints[family], p, n, repetition, presence, frequency)
                    for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
        assert expected != plain  # these penalties change tokens
        assert drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, seq_base=base, sampling=spec) == expected
        mixed = drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, seq_base=base + 10, sampling=[spec, None, spec])
        assert mixed == [expected[0], plain[1], expected[2]]  # the rows the last batch freed, taken again


@pytest.mark.parametrize("family", FAMILIES)
def test_a_logit_bias_is_added_to_the_logits_with_the_penalties(checkpoints: dict[str, Path], family: str) -> None:
    """A logit bias that bans the tokens greedy decoding picks first and favours two others (alone, and with a
    repetition penalty; beside an unbiased sequence; rows taken again by a second batch): the tokens of the
    definition written out over transformers' logits."""
    model = HFStepModel(checkpoints[family], dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    plain = _reference(checkpoints[family])[0]
    bias = {plain[0][0]: -100.0, plain[2][0]: -100.0, 7: 2.5, 11: 1.5}
    pairs = tuple(sorted(bias.items()))
    for base, repetition in ((0, 1.0), (20, 1.4)):
        spec = SamplingSpec(repetition=repetition, logit_bias=pairs)
        expected = [_penalized_greedy(checkpoints[family], p, n, repetition, 0.0, 0.0, bias)
                    for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
        assert expected[0][0] != plain[0][0] and expected[2][0] != plain[2][0]  # the banned tokens are gone
        mixed = drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, seq_base=base, sampling=[spec, None, spec])
        assert mixed == [expected[0], plain[1], expected[2]]
        again = drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, seq_base=base + 10, sampling=[None, spec, None])
        assert again == [plain[0], expected[1], plain[2]]
    unbiased = SamplingSpec(repetition=1.4)  # penalized only, in rows the biased sequences held: no bias left over
    assert drive(model, PROMPTS, NEW_TOKENS, JOINS, CHUNK, seq_base=40, sampling=unbiased) == [
        _penalized_greedy(checkpoints[family], p, n, 1.4, 0.0, 0.0) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]


def test_ep_statistics_are_the_last_iterations(checkpoints: dict[str, Path]) -> None:
    """Every MoE layer overwrites its rows of the expert counts and computed rows each iteration (the
    worker zeroes nothing between iterations): after a 10-token step, a 1-token step and an empty
    step, the counts are each step's own."""
    from vexpert_runtime.serve.moe_executors import EPExperts

    reader = checkpoint_reader(checkpoints["qwen3_moe"])
    executor = EPExperts.from_checkpoint(reader, reader.spec.num_layers, torch.float32, 0, 1, None, "cpu")
    model = HFStepModel(checkpoints["qwen3_moe"], dtype=torch.float32, kv_cache_tokens=KV_TOKENS, load_experts=False,
                        executor=executor)
    top_k = model.top_k
    for work, tokens in (([SequenceWork(1, tuple(range(1, 11)), 0, (1,))], 10),
                         ([SequenceWork(1, (4,), 10, (1,))], 1), ([], 0)):
        executor.counts.fill_(99)  # what an earlier iteration could have left
        executor.computed.fill_(99)
        model.step(work)
        assert executor.counts.sum(1).tolist() == [tokens * top_k] * len(model.moe_layers)
        assert executor.computed.sum(1).tolist() == [tokens * top_k] * len(model.moe_layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_bytes_per_token_counts_the_cache(checkpoints: dict[str, Path], family: str) -> None:
    """MLA caches the compressed latent + rotary key per token, GQA keys and values; a step writes
    exactly the slots of its sequences' new tokens (block 3's first 10 slots here), nothing else."""
    model = HFStepModel(checkpoints[family], dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    assert model.kv_cache is not None
    assert model.kv_cache_bytes == model.kv_num_blocks * model.kv_block_size * model.kv_bytes_per_token()
    model.step([SequenceWork(7, tuple(range(1, 11)), 0, (3,))])
    size = model.kv_block_size
    for layer in model.kv_cache.layers:
        written = layer.reshape(layer.shape[0], -1).abs().sum(1) > 0
        assert written.nonzero().flatten().tolist() == list(range(3 * size, 3 * size + 10))
    assert model.max_context == 128


def test_empty_step_still_runs_every_moe_layer(checkpoints: dict[str, Path]) -> None:
    model = HFStepModel(checkpoints["deepseek_v3"], dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    calls: list[tuple[int, int]] = []
    local = model.executor

    class Counting:
        def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            calls.append((moe_layer, x.shape[0]))
            return local.forward(moe_layer, x, ids, weights)

    model.executor = Counting()
    assert model.step([]).shape == (0,)
    assert calls == [(0, 0), (1, 0)]
    calls.clear()
    model.step([SequenceWork(1, (3, 4, 5), 0, (1,)), SequenceWork(2, (6,), 0, (2,))])
    assert calls == [(0, 4), (1, 4)]  # one call per MoE layer for the whole batch
    with pytest.raises(ValueError, match="0 blocks cannot hold 3 tokens"):  # a table that does not cover it
        model.step([SequenceWork(1, (9,), 2)])
    with pytest.raises(ValueError, match="twice"):
        model.step([SequenceWork(1, (9,), 3, (1,)), SequenceWork(1, (9,), 4, (1,))])


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_reader_reads_save_pretrained_layout(checkpoints: dict[str, Path], family: str) -> None:
    """transformers 5 fuses experts in memory but saves them per expert: CheckpointReader's rows
    equal the loaded model's, and the spec agrees with the model."""
    reader = checkpoint_reader(checkpoints[family])
    model = HFStepModel(checkpoints[family], dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    model.check_spec(reader.spec)
    assert reader.spec == read_model_spec(checkpoints[family])
    for layer in range(reader.spec.num_layers):
        assert torch.equal(reader.experts(layer, [0, 5, 7], torch.float32), model.expert_rows(layer, [0, 5, 7]))


# ---------------------------------------------------------------------------------------------
# Two EP ranks with vExpert slots
# ---------------------------------------------------------------------------------------------

WORLD = 2
SLOTS = 2


def hot_slots(counts: list[dict[int, int]], num_experts: int, world: int, slots: int) -> torch.Tensor:
    """slot_expert [L, N, S]: each rank's slots hold the hottest experts resident on other ranks."""
    per_gpu = num_experts // world
    out = torch.full((len(counts), world, slots), -1, dtype=torch.int64)
    for layer, count in enumerate(counts):
        for rank in range(world):
            foreign = [e for e in range(num_experts) if e // per_gpu != rank]
            hottest = sorted(foreign, key=lambda e: -count.get(e, 0))[:slots]
            out[layer, rank] = torch.tensor(hottest)
    return out


def _ep_rank(rank: int, path: str, port: int, slot_expert: torch.Tensor, slot_mode: str, result_dir: str) -> None:
    import torch.distributed as dist

    from vexpert_runtime.model.ep_moe import DeviceRoutingTable, plan_from_slots, table_from_plan
    from vexpert_runtime.policy.placement import static_placement
    from vexpert_runtime.serve.moe_executors import EPExperts, SlotHooks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = HFStepModel(path, dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
        layers, experts = len(model.moe_layers), model.num_experts
        plan = plan_from_slots(static_placement(layers, experts, WORLD), slot_expert)
        table = DeviceRoutingTable.of(table_from_plan(plan, plan_id=1), "cpu")
        slot_rows = [model.expert_rows(layer, slot_expert[layer, rank].tolist()) for layer in range(layers)]
        options: dict[str, Any] = {"table": table, "slots": slot_rows}
        if slot_mode == "buffer":
            # As the node worker: one slot buffer for all layers, filled right before a layer's slot
            # experts run and released after; a fixed dispatch capacity (no all-reduce per layer).
            buffer = torch.full_like(slot_rows[0], float("nan"))

            def release(_layer: int) -> None:
                buffer.fill_(float("nan"))  # a slot read after its release would poison the tokens

            options.update(slots=buffer, hooks=SlotHooks(lambda layer: buffer.copy_(slot_rows[layer]), release),
                           max_tokens=2 * CHUNK)
        model.executor = EPExperts.for_model(model, rank, WORLD, dist.group.WORLD, **options)
        model.drop_expert_weights()  # from here on only the executor's rows compute

        def more(local: bool) -> bool:
            flag = torch.tensor([int(local)])
            dist.all_reduce(flag)
            return bool(flag)

        # Rank 0 runs prompts 0 and 2, rank 1 prompt 1: uneven batches, and rank 1 finishes early
        # (then it steps with no work, in lockstep).
        mine = [i for i in range(len(PROMPTS)) if i % WORLD == rank]
        out = drive(model, [PROMPTS[i] for i in mine], [NEW_TOKENS[i] for i in mine], [JOINS[i] for i in mine],
                    CHUNK, more, seq_base=100 * rank)
        per_gpu = experts // WORLD
        slot_rows_computed = int(model.executor.computed[:, per_gpu:].sum())  # type: ignore[attr-defined]
        Path(result_dir, f"rank{rank}.json").write_text(
            json.dumps({"tokens": dict(zip(mine, out, strict=True)), "slot_rows": slot_rows_computed}))
        dist.barrier()  # both ranks done with the group before either leaves
    except BaseException:
        dist.destroy_process_group()
        raise
    # The result is written: leave without gloo's teardown, whose threads can abort a finished process
    # ("terminate called without an active exception", SIGABRT) on a loaded machine.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("family", "slot_mode"),
                         [("deepseek_v3", "buffer"), ("qwen3_moe", "per_layer"), ("qwen2_moe", "buffer")])
def test_ep_experts_with_slots_match_generate(checkpoints: dict[str, Path], family: str, slot_mode: str,
                                              tmp_path: Path) -> None:
    """per_layer: a slot stack per MoE layer, capacity agreed per layer; buffer: see _ep_rank."""
    import torch.multiprocessing as mp

    expected, counts = _reference(checkpoints[family])
    slot_expert = hot_slots(counts, 8, WORLD, SLOTS)
    mp.spawn(_ep_rank, args=(str(checkpoints[family]), _free_port(), slot_expert, slot_mode, str(tmp_path)), nprocs=WORLD,
             join=True)
    tokens: dict[int, list[int]] = {}
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        tokens.update({int(i): t for i, t in result["tokens"].items()})
        assert result["slot_rows"] > 0, f"rank {rank} computed nothing in its slots"
    assert [tokens[i] for i in range(len(PROMPTS))] == expected


# ---------------------------------------------------------------------------------------------
# The demo checkpoint
# ---------------------------------------------------------------------------------------------


def test_demo_model_builds_once_loads_offline_and_generates(tmp_path: Path) -> None:
    import time

    from vexpert_runtime.serve.demo_model import EOS, ensure_demo_model

    start = time.perf_counter()
    path = ensure_demo_model(tmp_path / "demo")
    built_s = time.perf_counter() - start
    assert built_s < 10
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 12 * 2**20
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(path) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name != "demo"]  # no staging directory left behind

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert tokenizer.eos_token == EOS
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello! What is expert parallelism?"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>\n")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == prompt  # byte-level BPE round-trips

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    assert model.config.model_type == "deepseek_v3" and model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    input_ids = torch.tensor([ids])
    generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                               max_new_tokens=8, eos_token_id=None)[0, len(ids):].tolist()
    assert len(generated) == 8
    assert isinstance(tokenizer.decode(generated), str)

    step_model = HFStepModel(path, dtype=torch.float32, kv_cache_tokens=KV_TOKENS)
    assert drive(step_model, [ids], [8], [0], 5) == [generated]
    assert step_model.kv_bytes_per_token() == 4 * (32 + 16) * 4  # 4 layers × (kv_lora_rank + rope dim) × fp32


def test_bf16_step_model_runs(tmp_path: Path) -> None:
    """The default compute dtype (bf16): a prompt and a decode sample in-vocabulary tokens; a chunk
    that does not end its prompt samples nothing."""
    from vexpert_runtime.serve.demo_model import ensure_demo_model

    model = HFStepModel(ensure_demo_model(tmp_path / "demo"), kv_cache_tokens=KV_TOKENS)
    assert model.dtype == torch.bfloat16
    greedy = SamplingSpec()
    tokens = model.step([SequenceWork(0, (4, 5, 6, 7), 0, (1,), greedy), SequenceWork(1, (8,), 0, (2,), None)])
    assert tokens[1] == -1 and 0 <= int(tokens[0]) < model.vocab_size
    tokens = model.step([SequenceWork(0, (int(tokens[0]),), 4, (1,), SamplingSpec(0.8, 0.9, seed=5, draw=1))])
    assert tokens.shape == (1,) and 0 <= int(tokens[0]) < model.vocab_size


def test_quantised_expert_weights_are_refused() -> None:
    """FP8 fused weights carry their scales elsewhere: rows must come from the checkpoint reader."""
    from vexpert_runtime.serve.moe_executors import packed_rows

    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4).to(torch.float8_e4m3fn), requires_grad=False)
    experts.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 4).to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match="checkpoint_reader"):
        packed_rows(experts, [0])
    with pytest.raises(ValueError, match="checkpoint_reader"):
        LocalExperts([experts])
