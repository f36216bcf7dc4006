"""The host side of a graphed iteration's inputs (:class:`~vexpert_runtime.serve.cuda_graphs.GraphInputs`),
which runs on CPU: every field a replay reads, for a mixed batch, and nothing left over from a
larger batch before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vexpert_runtime.serve.cuda_graphs import GraphInputs, graph_key, table_width, token_buckets
from vexpert_runtime.serve.kv_cache import SCRATCH_BLOCK
from vexpert_runtime.serve.penalties import PenaltyRows
from vexpert_runtime.serve.sampling import SamplingSpec
from vexpert_runtime.serve.step import SequenceWork

BLOCK = 4


def _expected(work: list[SequenceWork], tokens: int, seqs: int) -> dict[str, list[float]]:
    """Every field, written out row by row (the definition ``fill`` must match)."""
    out: dict[str, list[float]] = {name: [] for name in ("tokens", "positions", "slots", "lengths", "seqs", "valid", "fed")}
    rows, seeds, draws, temperature, top_p, top_k, min_p = [], [], [], [], [], [], []
    for b, item in enumerate(work):
        for i, token in enumerate(item.tokens):
            position = item.position + i
            last = i == len(item.tokens) - 1
            out["tokens"].append(token)
            out["positions"].append(position)
            out["lengths"].append(position + 1)
            out["seqs"].append(b)
            out["valid"].append(1)
            out["slots"].append(item.blocks[position // BLOCK] * BLOCK + position % BLOCK)
            out["fed"].append(item.fed if last and item.fed is not None else -1)
            if last and item.sample is not None:
                rows.append(len(out["tokens"]) - 1)
                seeds.append(item.sample.seed)
                draws.append(item.sample.draw)
                temperature.append(item.sample.temperature)
                top_p.append(item.sample.top_p)
                top_k.append(item.sample.top_k)
                min_p.append(item.sample.min_p)
    pad = tokens - len(out["tokens"])
    for name, value in (("tokens", 0), ("positions", 0), ("lengths", 0), ("seqs", 0), ("valid", 0), ("fed", -1),
                        ("slots", SCRATCH_BLOCK * BLOCK)):
        out[name] += [value] * pad
    free = seqs - len(rows)
    out |= {"rows": rows + [0] * free, "seeds": seeds + [0] * free, "draws": draws + [0] * free,
            "temperature": temperature + [0.0] * free, "top_p": top_p + [0.0] * free, "top_k": top_k + [0] * free,
            "min_p": min_p + [0.0] * free}
    return out


def test_fill_writes_every_field_and_resets_the_pad_rows() -> None:
    inputs = GraphInputs.allocate(tokens=24, seqs=6, width=8, device="cpu")
    big = [SequenceWork(0, tuple(range(10, 22)), 0, (5, 6, 7), SamplingSpec(0.0, 1.0, 3, 0)),
           SequenceWork(1, (9,), 6, (2, 3), SamplingSpec(0.8, 0.9, 4, 2, top_k=20, min_p=0.05), fed=0),
           SequenceWork(2, tuple(range(30, 38)), 4, (1, 4, 9), None),  # a middle prompt chunk: no sample
           SequenceWork(3, (7,), 13, (11, 12, 13, 14), SamplingSpec(1.0, 0.5, 5, 9))]
    small = [SequenceWork(4, (8,), 2, (15,), SamplingSpec(0.0, 1.0, 6, 1), fed=1),
             SequenceWork(5, (1, 2, 3), 0, (16,), SamplingSpec(0.0, 1.0, 7, 0))]
    decodes = [SequenceWork(6, (5,), 3, (2,), SamplingSpec(0.0, 1.0, 8, 3), fed=0),  # one token each: fill's fast path
               SequenceWork(7, (4,), 9, (3, 8, 10), SamplingSpec(0.7, 0.95, 9, 5, top_k=3))]
    for work in (big, small, decodes, []):
        sampled = inputs.fill(work, BLOCK)
        want = _expected(work, 24, 6)
        assert sampled == sum(item.sample is not None for item in work)
        for name, values in want.items():
            assert np.array_equal(inputs.views[name].numpy(), np.array(values, dtype=inputs.views[name].numpy().dtype)), name
        for b, item in enumerate(work):
            assert inputs.tables[b, : len(item.blocks)].tolist() == list(item.blocks)
        # what a launch copies to the device: the fields and the tables' columns up to the longest
        device = GraphInputs.allocate(tokens=24, seqs=6, width=8, device="cpu")
        device.buffer.fill_(-7)  # stale: what earlier iterations left
        used = inputs.used(work)
        device.buffer[:used].copy_(inputs.buffer[:used])
        assert used == 24 * 9 + 6 * 11 + 6 * max([len(item.blocks) for item in work] + [1]) < inputs.buffer.numel()
        for name, view in inputs.views.items():
            assert torch.equal(device.views[name], view), name
        for b, item in enumerate(work):
            assert device.tables[b, : len(item.blocks)].tolist() == list(item.blocks)


def test_fill_writes_the_penalty_fields_when_a_sequence_is_penalized() -> None:
    """With penalty rows, each token row names its sequence's row and whether it is output (at or past
    the prompt's length), each sampling row its row and penalties; pad rows the scratch row, neutral."""
    inputs = GraphInputs.allocate(tokens=16, seqs=4, width=8, device="cpu")
    penalized = SamplingSpec(0.0, 1.0, 3, 0, repetition=1.3, presence=0.5, frequency=-0.25)
    work = [SequenceWork(0, (10, 11, 12, 13), 4, (5, 6), penalized, penalty_prompt_len=6),  # a chunk past the prompt
            SequenceWork(1, (9,), 6, (2, 3), SamplingSpec(0.8, 0.9, 4, 2)),  # not penalized
            SequenceWork(2, (20, 21), 0, (7,), None, penalty_prompt_len=5)]  # a prompt chunk, no sample
    scratch = 9
    sampled = inputs.fill(work, BLOCK, PenaltyRows([3, scratch, 0], scratch))
    v = {name: view.tolist() for name, view in inputs.views.items()}
    assert sampled == 2
    assert v["penalty_rows"] == [3, 3, 3, 3, scratch, 0, 0] + [scratch] * 9
    assert v["outputs"] == [0, 0, 1, 1, 0, 0, 0] + [0] * 9  # positions 6, 7 of sequence 0 are output
    # what the step reads as it is (no conversion kernel in a replay): bool and float32 views of the int64 buffer
    assert {name: inputs.views[name].dtype for name in ("outputs", "valid", "repetition", "temperature")} == {
        "outputs": torch.bool, "valid": torch.bool, "repetition": torch.float32, "temperature": torch.float32}
    assert v["penalty_sample_rows"] == [3, scratch, scratch, scratch]
    assert v["repetition"] == pytest.approx([1.3, 1.0, 1.0, 1.0], rel=1e-7)  # float32
    assert v["presence"] == [0.5, 0.0, 0.0, 0.0] and v["frequency"] == [-0.25, 0.0, 0.0, 0.0]
    assert graph_key(work, token_buckets(16), BLOCK, None, 2).penalties
    assert not graph_key(work[1:2], token_buckets(16), BLOCK, None, 2).penalties


@pytest.mark.parametrize("max_tokens", [1, 7, 64, 256, 300, 512, 513, 2048, 8192])
def test_every_token_count_has_a_bucket_padded_by_at_most_an_eighth_above_256(max_tokens: int) -> None:
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for tokens in range(1, max_tokens + 1):
        bucket = next(b for b in buckets if b >= tokens)
        if tokens > 16:
            # fine steps where decodes run (every 16 rows up to 256, 32 up to 512), an eighth above
            assert bucket - tokens < max(16 if tokens <= 256 else 32, tokens // 8 + 1)
    # graphs are captured at start and held: their number grows with log(max_tokens)
    assert len(token_buckets(8192)) <= len(token_buckets(1024)) + 24


def test_graph_key_picks_the_bucket_top_p_and_the_splits_of_the_longest_table() -> None:
    """The graph an iteration replays: its bucket, a truncated-sampling variant only when a sampled row
    draws with min-p, top-k or top-p (greedy rows ignore them), a log-probabilities variant when a row
    asks for them, and the split count the model's policy gives for that bucket at the
    longest context the block tables reach — from an H200's policy for DeepSeek-V3's 128 MLA heads."""
    from vexpert_runtime.serve.attention_kernels import mla_kv_splits

    def policy(rows: int, longest: int) -> int:
        return mla_kv_splits(rows, 128, longest, 132)

    buckets = token_buckets(512)
    short = [SequenceWork(0, (5,), 90, tuple(range(6)), SamplingSpec()), SequenceWork(1, (6,), 10, (7,), SamplingSpec())]
    assert table_width(short) == 6
    assert graph_key(short, buckets, 16, policy, table_width(short)) == (2, False, 1, False, False)  # 96 tokens: one pass
    long_table = tuple(range(10, 10 + 2048))  # a 32,768-token context
    long = [SequenceWork(0, (5,), 32_000, long_table, SamplingSpec(temperature=0.7, top_p=0.9)), *short[1:]]
    assert graph_key(long, buckets, 16, policy, table_width(long)) == (2, True, 32, False, False)  # 4 split programs → 32 splits
    assert graph_key(long, buckets, 16, None, table_width(long)) == (2, True, 1, False, False)  # no policy: one pass
    greedy_top_p = [SequenceWork(0, (5,), 9, (1,), SamplingSpec(temperature=0.0, top_p=0.5, top_k=4, min_p=0.2))]
    assert graph_key(greedy_top_p, buckets, 16, policy, 1)[1] is False
    for truncated in (SamplingSpec(temperature=0.7, top_k=20), SamplingSpec(temperature=0.7, min_p=0.1)):
        assert graph_key([SequenceWork(0, (5,), 9, (1,), truncated)], buckets, 16, policy, 1)[1] is True
    assert graph_key([SequenceWork(0, (5,), 9, (1,), SamplingSpec(temperature=0.7))], buckets, 16, policy, 1)[1] is False
    chunk = [SequenceWork(0, tuple(range(300)), 0, tuple(range(19))), *long]  # 302 tokens: the SMs are full
    assert graph_key(chunk, buckets, 16, policy, table_width(chunk)) == (320, True, 1, False, False)
    # a row asking for log-probabilities: a graph variant of its own (greedy or not)
    asks = [*short, SequenceWork(2, (7,), 3, (8,), SamplingSpec(logprobs=True))]
    assert graph_key(asks, buckets, 16, policy, table_width(asks)) == (4, False, 1, True, False)
