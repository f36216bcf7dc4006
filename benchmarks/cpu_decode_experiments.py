"""Two CPU experiments that were measured and not adopted (benchmarks/results/cpu_compare/README.md).

``pairwise``: whole 16-sequence decode iterations of a checkpoint through the product's
:class:`~vexpert_runtime.serve.hf_model.HFStepModel` on one rank, its expert loop
(``grouped_moe.grouped_swiglu`` as ``ep_moe`` calls it) against the same SwiGLU written as one pairwise
reduction compiled by inductor (``torch.compile``: a C++ kernel) where the groups are small, interleaved
A/B, medians. ``detokenize``: the product's ``IncrementalDetokenizer.push`` for 256 sequences an iteration
against the same arithmetic with both windows of every sequence decoded in one Rust ``decode_batch``.

    .venv/bin/python benchmarks/cpu_decode_experiments.py pairwise --model /tmp/cpu-compare/model
    .venv/bin/python benchmarks/cpu_decode_experiments.py detokenize --model /tmp/cpu-compare/model
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

import vexpert_runtime.model.ep_moe as ep_moe
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.kv_cache import BlockPool
from vexpert_runtime.serve.moe_executors import EPExperts
from vexpert_runtime.serve.sampling import IncrementalDetokenizer, SamplingSpec
from vexpert_runtime.serve.step import SequenceWork


def pair_swiglu(x: torch.Tensor, expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each row x [P, H] by its own expert [P] (w13 [E, 2I, H], w2 [E, H, I]) → [P, H]."""
    intermediate = w2.shape[-1]
    h = (w13[expert] * x[:, None, :]).sum(-1)
    return (w2[expert] * (F.silu(h[:, :intermediate]) * h[:, intermediate:])[:, None, :]).sum(-1)


def pairwise(model_dir: str, rounds: int) -> dict[str, Any]:
    loop = ep_moe.grouped_swiglu
    compiled = torch.compile(pair_swiglu, dynamic=True)

    def small_groups(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                     grouped: bool | None = None) -> torch.Tensor:
        ends = offs.to(torch.int64)
        rows = int(ends[-1]) if ends.numel() else 0
        if grouped or rows == 0 or rows > 4 * ends.numel():  # large groups: the loop's GEMMs
            return loop(x, w13, w2, offs, grouped)
        expert = torch.repeat_interleave(torch.arange(ends.numel()), torch.diff(ends, prepend=ends.new_zeros(1)))
        out = torch.empty_like(x)
        out[:rows] = compiled(x[:rows], expert, w13, w2)
        return out

    model = HFStepModel(model_dir, dtype=torch.float32, kv_cache_tokens=16384)
    model.executor = EPExperts.for_model(model, 0, 1, None)
    model.drop_expert_weights()
    pool, rng, sequences, context = BlockPool(model.kv_num_blocks, model.kv_block_size), random.Random(0), 16, 64
    for seq in range(sequences):
        pool.add(seq)
    model.step([SequenceWork(seq, tuple(rng.randrange(model.vocab_size) for _ in range(context)), 0,
                             tuple(pool.grow(seq, context)), SamplingSpec(draw=0)) for seq in range(sequences)])
    position = context

    def decode() -> None:
        nonlocal position
        model.step([SequenceWork(seq, (rng.randrange(model.vocab_size),), position, tuple(pool.grow(seq, position + 1)),
                                 SamplingSpec(draw=position - context)) for seq in range(sequences)])
        position += 1

    ep_moe.grouped_swiglu = small_groups  # type: ignore[assignment]
    start = time.perf_counter()
    decode()
    compile_s = time.perf_counter() - start
    times: dict[str, list[float]] = {"pairwise": [], "loop": []}
    for _ in range(rounds):
        for name, fn in (("pairwise", small_groups), ("loop", loop)):
            ep_moe.grouped_swiglu = fn  # type: ignore[assignment]
            start = time.perf_counter()
            for _ in range(3):
                decode()
            times[name].append((time.perf_counter() - start) / 3 * 1e3)
    ep_moe.grouped_swiglu = loop
    return {"first_call_s (compile)": round(compile_s, 2),
            **{f"decode_16_ms_{name}": round(statistics.median(v), 2) for name, v in times.items()},
            "speedup": round(statistics.median(times["loop"]) / statistics.median(times["pairwise"]), 3)}


def detokenize(model_dir: str, iterations: int = 64, sequences: int = 256) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng, vocab = random.Random(0), len(tokenizer)
    prompts = [[rng.randrange(vocab) for _ in range(60)] for _ in range(sequences)]
    steps = [[rng.randrange(vocab) for _ in range(sequences)] for _ in range(iterations)]

    def batched(detokenizers: list[IncrementalDetokenizer], tokens: list[int]) -> list[str]:
        for d, token in zip(detokenizers, tokens, strict=True):
            d.ids.append(token)
        windows = [w for d in detokenizers for w in (d.ids[d.prefix_offset:d.read_offset], d.ids[d.prefix_offset:])]
        texts = tokenizer.backend_tokenizer.decode_batch(windows, skip_special_tokens=True)
        out = []
        for d, prefix, new in zip(detokenizers, texts[::2], texts[1::2], strict=True):
            if len(new) <= len(prefix) or new.endswith("\ufffd"):
                out.append("")
                continue
            d.prefix_offset, d.read_offset = d.read_offset, len(d.ids)
            out.append(new[len(prefix):])
        return out

    result, texts = {}, {}
    for name in ("push", "decode_batch"):
        detokenizers = [IncrementalDetokenizer(tokenizer, p) for p in prompts]
        start, produced = time.perf_counter(), []
        for row in steps:
            produced.append(batched(detokenizers, row) if name == "decode_batch"
                            else [d.push(t) for d, t in zip(detokenizers, row, strict=True)])
        result[f"{name}_ms_per_iteration"] = round((time.perf_counter() - start) / iterations * 1e3, 3)
        texts[name] = produced
    result["same_text"] = texts["push"] == texts["decode_batch"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", choices=("pairwise", "detokenize"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = pairwise(args.model, args.rounds) if args.experiment == "pairwise" else detokenize(args.model)
    print(json.dumps({"torch": torch.__version__, args.experiment: result}))


if __name__ == "__main__":
    main()
