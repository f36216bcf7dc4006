"""The serving loop's host cost per iteration, without a device: what bounds GPU busy at many streams.

On a GPU the rank launches iteration i+1 before it reads iteration i (overlapped steps), so the GPU
stays busy only while the host's per-iteration Python — forming the batch, filling the graph's
inputs, reading and detokenizing the tokens, sending the events — is shorter than the graph. This
drives the product's own :class:`~vexpert_runtime.serve.scheduler.Scheduler` with an overlapping
step model that does no compute but the host half of a graph launch
(:meth:`~vexpert_runtime.serve.cuda_graphs.GraphInputs.fill` into a host buffer), and
``ServingRank``'s event path (the events of an iteration pickled as one ``RankEvent``), at N
closed-loop streams (a finished request is replaced at once), and reports microseconds per
iteration and where they go (cProfile, by function). The process freezes its
heap after the first iteration as a GPU worker does (:func:`~vexpert_runtime.gc_heap.freeze_heap`; ``--no-gc-freeze``: not) and
reports the seconds per iteration it then spent in Python's cyclic collector, by generation.

    python benchmarks/serve_host_cost.py --streams 256 --iterations 400          # µs per iteration
    python benchmarks/serve_host_cost.py --streams 256 --iterations 400 --profile # + top functions
    python benchmarks/serve_host_cost.py --streams 256 --iterations 400 --no-gc-freeze   # the collector's cost
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pickle
import pstats
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vexpert_runtime.gc_heap import GcClock, freeze_heap
from vexpert_runtime.serve.cuda_graphs import GraphInputs
from vexpert_runtime.serve.demo_model import ensure_demo_model
from vexpert_runtime.serve.events import Event, GenerationRequest, RankEvent, SamplingParams
from vexpert_runtime.serve.sampling import eos_token_ids
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig
from vexpert_runtime.serve.step import FinishedStep, PendingStep, SequenceWork


class HostOnlyStepModel:
    """An overlapping :class:`~vexpert_runtime.serve.step.StepModel` that only does a graph launch's
    host work (fills a :class:`GraphInputs` host buffer) and returns random tokens."""

    overlaps_steps = True
    kv_block_size = 16
    kv_cache_bytes = 0

    def __init__(self, vocab_size: int, max_context: int, max_tokens: int, max_seqs: int, blocks: int) -> None:
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.kv_num_blocks = blocks
        self.inputs = GraphInputs.allocate(max_tokens, max_seqs, -(-max_context // self.kv_block_size), "cpu")
        self.rng = np.random.default_rng(0)

    def kv_bytes_per_token(self) -> int:
        return 0

    def launch(self, work: Sequence[SequenceWork]) -> PendingStep:
        self.inputs.fill(work, self.kv_block_size)
        tokens = torch.from_numpy(self.rng.integers(3, self.vocab_size, len(work)))
        return FinishedStep(tokens)

    def step(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        return self.launch(work).result()

    def release(self, seq_id: int) -> None:
        pass


def run(streams: int, iterations: int, prompt_tokens: int, max_tokens: int, profile: bool,
        gc_freeze: bool = True) -> dict[str, object]:
    from transformers import AutoTokenizer

    model_dir = ensure_demo_model(Path(tempfile.gettempdir()) / "vexpert-demo-model")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    vocab = len(tokenizer)
    max_context = 2048
    config = SchedulerConfig(kv_budget_tokens=None, max_batch_tokens=max(512, streams * 2), max_running=streams,
                             max_waiting=streams * 2)
    blocks = streams * (-(-(prompt_tokens + max_tokens) // 16) + 1) + 2
    model = HostOnlyStepModel(vocab, max_context, config.max_batch_tokens, streams, blocks)
    scheduler = Scheduler(model, tokenizer, config, eos_token_ids(tokenizer))
    rng = np.random.default_rng(1)
    outbox: list[Event] = []
    sent = {"n": 0}

    def submit() -> None:
        sent["n"] += 1
        prompt = tuple(int(t) for t in rng.integers(3, vocab, prompt_tokens))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        scheduler.submit(GenerationRequest(f"r{sent['n']}", prompt, params), outbox.append)

    for _ in range(streams):
        submit()
    pickled = 0

    def iteration() -> None:
        nonlocal pickled
        scheduler.run_iteration()
        events = tuple(outbox)
        outbox.clear()
        pickled += len(pickle.dumps(RankEvent(0, events)))  # what the rank's events queue does per iteration
        for event in events:
            if event.finished:
                submit()

    iteration()
    if gc_freeze:  # where a GPU worker freezes its heap (again): after iteration 0
        freeze_heap()
    for _ in range(max_tokens * 2 - 1):  # warm-up: past the first wave of prefills
        iteration()
    clock = GcClock().install()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(iterations):
        iteration()
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - start
    clock.uninstall()
    tracked = len(gc.get_objects())  # what a full collection traverses
    gc.unfreeze()  # the next run starts from the same state
    result: dict[str, object] = {"streams": streams, "iterations": iterations, "us_per_iteration":
                                 round(elapsed / iterations * 1e6, 1), "profiled": profile,
                                 "event_bytes_per_iteration": pickled // (iterations + max_tokens * 2),
                                 "gc_freeze": gc_freeze, "tracked_objects": tracked,
                                 "gc_us_per_iteration": [round(s / iterations * 1e6, 1) for s in clock.totals()],
                                 "gc_collections": clock.collections}
    if profiler is not None:
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:30]  # type: ignore[attr-defined]
        result["top_cumulative_us_per_iteration"] = [
            (f"{Path(f).name}:{line} {name}", round(ct / iterations * 1e6, 1), round(tt / iterations * 1e6, 1))
            for (f, line, name), (_, _, tt, ct, _) in rows]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[256])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=62)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="cProfile the measured iterations (slower)")
    parser.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                        help="leave the heap in the collector's generations (what the workers did before)")
    parser.add_argument("--out", type=Path, help="append the results as JSON lines")
    args = parser.parse_args()
    for streams in args.streams:
        result = run(streams, args.iterations, args.prompt_tokens, args.max_tokens, args.profile, args.gc_freeze)
        line = json.dumps(result)
        print(line)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
