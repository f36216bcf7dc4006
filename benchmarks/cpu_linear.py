"""oneDNN vs the BLAS for the fp32 linears of a CPU serving rank (``vexpert_runtime.model.cpu_linear``).

Two measurements, one torch thread, both through the product's code:

* ``shapes``: ``cpu_linear.linear`` (oneDNN) against ``F.linear`` on the projection shapes of the
  compare checkpoint (hidden 512) at 1–128 rows, median of 200 calls each;
* ``steps``: whole :class:`~vexpert_runtime.serve.hf_model.HFStepModel` iterations of a checkpoint
  with its EP executor on one rank — a prefill of 4 × 64-token prompts and a 16-sequence decode —
  with oneDNN on and off *interleaved* (off = ``cpu_linear`` told oneDNN is absent), medians over
  ``--rounds`` rounds. Interleaving matters on a shared machine: back-to-back runs of one variant
  drifted by ±20 % here, more than the effect.

    .venv/bin/python benchmarks/cpu_linear.py --model /tmp/cpu-compare/model   # cpu_serve_compare.py's checkpoint
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

from vexpert_runtime.model import cpu_linear
from vexpert_runtime.serve.hf_model import EPExperts, HFStepModel
from vexpert_runtime.serve.kv_cache import BlockPool
from vexpert_runtime.serve.sampling import SamplingSpec
from vexpert_runtime.serve.step import SequenceWork

_ONEDNN = cpu_linear._onednn_available


def use_onednn(on: bool) -> None:
    cpu_linear._onednn_available = _ONEDNN if on else (lambda: False)  # type: ignore[assignment]


def shapes(hidden: int = 512) -> list[dict[str, Any]]:
    rows = []
    for out in (hidden, hidden // 2, 32):
        w = torch.randn(out, hidden)
        for m in (1, 16, 48, 128):
            x = torch.randn(m, hidden)
            times = {}
            for name, fn in (("onednn", lambda x=x, w=w: cpu_linear.linear(x, w)), ("blas", lambda x=x, w=w: F.linear(x, w))):
                for _ in range(10):
                    fn()
                samples = []
                for _ in range(200):
                    t = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t)
                times[name] = round(statistics.median(samples) * 1e6, 1)
            rows.append({"weight": [out, hidden], "rows": m, "onednn_us": times["onednn"], "blas_us": times["blas"]})
    return rows


def steps(model_dir: str, rounds: int) -> dict[str, Any]:
    model = HFStepModel(model_dir, dtype=torch.float32, kv_cache_tokens=16384)
    model.executor = EPExperts.for_model(model, 0, 1, None)
    model.drop_expert_weights()
    pool = BlockPool(model.kv_num_blocks, model.kv_block_size)
    rng = random.Random(0)
    vocab = model.vocab_size
    ids = iter(range(1, 10**9))

    def prompt_step() -> list[SequenceWork]:
        work = []
        for _ in range(4):
            seq = next(ids)
            pool.reserve(seq, 64)
            work.append(SequenceWork(seq, tuple(rng.randrange(vocab) for _ in range(64)), 0, tuple(pool.grow(seq, 64)),
                                     SamplingSpec(draw=0)))
        return work

    decoding = prompt_step() + prompt_step() + prompt_step() + prompt_step()  # 16 sequences at 64 tokens
    for seq in decoding:
        pool.free(seq.seq_id)
        pool.reserve(seq.seq_id, 64 + 4 * rounds + 8)
    model.step(decoding)
    position = 64
    results: dict[str, dict[bool, list[float]]] = {"prefill_4x64_ms": {True: [], False: []}, "decode_16_ms": {True: [], False: []}}
    for _ in range(rounds):
        for on in (True, False):
            use_onednn(on)
            work = prompt_step()
            t = time.perf_counter()
            model.step(work)
            results["prefill_4x64_ms"][on].append((time.perf_counter() - t) * 1e3)
            for item in work:
                pool.free(item.seq_id)
            t = time.perf_counter()
            for _ in range(2):
                model.step([SequenceWork(seq.seq_id, (rng.randrange(vocab),), position, tuple(pool.grow(seq.seq_id, position + 1)),
                                         SamplingSpec(draw=position - 64)) for seq in decoding])
                position += 1
            results["decode_16_ms"][on].append((time.perf_counter() - t) / 2 * 1e3)
    use_onednn(True)
    return {name: {"onednn": round(statistics.median(v[True]), 2), "blas": round(statistics.median(v[False]), 2),
                   "speedup": round(statistics.median(v[False]) / statistics.median(v[True]), 3)}
            for name, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local checkpoint directory (float32 CPU steps)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"torch": torch.__version__, "shapes": shapes(), "steps": steps(args.model, args.rounds)}, indent=1))


if __name__ == "__main__":
    main()
