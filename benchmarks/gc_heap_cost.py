"""What one full cyclic collection costs a serving rank, and what :func:`~vexpert_runtime.gc_heap.freeze_heap`
leaves of it (CPU; the rank's own classes).

Builds a rank's model as ``ServingRank`` does (:class:`~vexpert_runtime.serve.hf_model.HFStepModel`, one EP
rank's :class:`~vexpert_runtime.serve.moe_executors.EPExperts`, its paged KV cache), serves a few requests through
the product's :class:`~vexpert_runtime.serve.scheduler.Scheduler`, eagerly and then with the step's pieces
compiled by inductor (what a GPU rank runs: ``--compile auto`` compiles wherever CUDA graphs run), and reports
the objects a full collection traverses and how long one takes — before and after the freeze a worker does
after its iteration 0 (a GPU worker; a CPU worker freezes before it reports ready).

    python benchmarks/gc_heap_cost.py                      # the tiny DeepSeek-V3 of the tests, float32
    python benchmarks/gc_heap_cost.py --model-dir DIR      # any checkpoint the server serves
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch

from vexpert_runtime.gc_heap import freeze_heap
from vexpert_runtime.serve.events import GenerationRequest, SamplingParams
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.moe_executors import EPExperts, checkpoint_reader
from vexpert_runtime.serve.sampling import eos_token_ids
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig


def full_collection_ms(repeats: int = 3) -> float:
    """Median wall time of a full collection (ms)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 1)


def serve_some(model: HFStepModel, tokenizer: Any, requests: int = 8, max_tokens: int = 16) -> int:
    """Requests through the product's scheduler until they are done; the iterations it took."""
    scheduler = Scheduler(model, tokenizer, SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=64,
                                                            max_running=8), eos_token_ids(tokenizer))
    done: list[bool] = []
    for i in range(requests):
        prompt = tuple(tokenizer.encode(f"request {i}: the quick brown fox jumps over the lazy dog"))
        scheduler.submit(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                         lambda event: done.append(True) if event.finished else None)
    iterations = 0
    while len(done) < requests:
        scheduler.run_iteration()
        iterations += 1
    return iterations


def measure(model_dir: Path) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rows = []
    for compiled in (False, True):
        # rank-local, as ServingRank loads: this rank's expert rows from the shards, the rest without experts
        reader = checkpoint_reader(model_dir)
        experts = EPExperts.from_checkpoint(reader, reader.spec.num_layers, torch.float32, 0, 1, None, "cpu")
        model = HFStepModel(model_dir, dtype=torch.float32, kv_cache_tokens=2048, load_experts=False, executor=experts)
        del reader
        if compiled:
            model.compile_pieces()
        model.step([])  # a rank's iteration 0
        iterations = serve_some(model, tokenizer)
        row = {"compiled": compiled, "iterations": iterations, "tracked_objects": len(gc.get_objects()),
               "full_collection_ms": full_collection_ms()}
        row["frozen_objects"] = freeze_heap()
        row["tracked_after_freeze"] = len(gc.get_objects())
        serve_some(model, tokenizer)
        row["full_collection_ms_after_freeze"] = full_collection_ms()
        gc.unfreeze()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a checkpoint (default: the tests' tiny DeepSeek-V3)")
    parser.add_argument("--out", type=Path, help="append the rows as JSON lines")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from serve_support import build_tiny_checkpoint

            model_dir = Path(tmp) / "deepseek_v3"
            build_tiny_checkpoint(model_dir, "deepseek_v3")
        rows = measure(model_dir)
    if args.out:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps({"model": str(args.model_dir or "tiny deepseek_v3"), **row}) + "\n")


if __name__ == "__main__":
    main()
