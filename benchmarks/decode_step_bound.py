"""A pure decode step on a GPU beside the bytes it must read: how far the graphed step is from HBM bandwidth.

Served iterations mix decodes with the prompt chunks of requests that replace finished ones, so a traced
serving iteration (``serve_engine.py --profile-streams``) is not the decode step the HBM bound describes.
This builds what a serving rank runs — :class:`~vexpert_runtime.serve.hf_model.HFStepModel` with the EP
layer on one rank (:class:`~vexpert_runtime.serve.moe_executors.EPExperts`), its pieces compiled, CUDA graphs per
token bucket — on ``serve_engine.py``'s checkpoint, and times ``--iters`` back-to-back launches of one
decode step of B sequences at context ``--context`` (the same step relaunched: it rewrites the same KV
slots) between two CUDA events, after warm-up (``launch_span_ms``: with the host's input fill between
steps), then the bucket's graph alone, replayed back to back on the same inputs (``graph_ms``: the GPU's
time for the step; ``replay_host_ms``: the host's time to launch it). The bound is ``serve_engine.hbm_bound``: non-embedding weights (every expert hit) + the batch's
embedding rows + the KV cache at that context, ÷ 4.8 TB/s (an H200's: issue #21's yardstick on any card);
``card_bound_ms`` / ``graph_over_card_bound``: the same bytes ÷ the bandwidth of the card that ran (an H100 SXM's
3.35 TB/s, ``serve_engine.CARD_HBM_BYTES_PER_S``).

    python benchmarks/decode_step_bound.py --batches 16 64 256 --context 96 --out out/decode_step_bound.json

Also printed per batch: ``flop_ms``, the step's matmul FLOPs (2 × the weights a token multiplies — its
top-k experts, not all — plus MLA's latent attention over the context) ÷ the GPU's dense bf16 peak
(``--peak-tflops``, 989 for an H200), the other floor a step of many tokens meets; and with ``--profile``
the graph's kernels by name (torch.profiler over ``--iters`` replays: CUDA ms and launches per step, the ``--top`` largest, and the kernels' total).

With ``--prefill-chunks P…`` each batch also runs as a served iteration mixes it: the B decodes plus P
prompt chunks of ``--chunk`` tokens (new sequences, from position 0, each sampling its first token), the
graph of that bucket replayed alone (``graph_ms``) — what a prompt token costs on top of a decode step,
which is what ``--max-batch-tokens`` trades (larger: fewer iterations carry prompts, but those take longer).

    python benchmarks/decode_step_bound.py --batches 64 256 --prefill-chunks 0 2 8 16 --max-batch-tokens 2048

``--sampling top-p|top-k`` samples every sequence as a request that leaves its sampling fields to DeepSeek-V3's
(temperature 0.6, top-p 0.95) or Qwen3's (and top-k 20) generation config does under ``--generation-config auto``:
the graph then sorts the vocabulary per sequence (greedy, the default, skips it) — what that sort costs the step.
``--sampling penalties``: greedy with a repetition penalty of 1.05 (the penalty tables written and read in the
graph). ``--sampling logprobs``: greedy, every sequence asking for log-probabilities (``logprobs``: a log-softmax and a
top-20 over the vocabulary in the graph, three more device→host copies) — what they cost the step.
``--sampling grammar``: greedy, every sequence constrained by structured output (a grammar mask allowing every
other token, written into its bias row ahead of each launch, then the penalty graph) — its ``launch_span_ms``
holds the mask's upload and unpack, ``graph_ms`` only the graph.

``--shared-expert-stream off``: every sparse block's shared expert on the step's one stream, for an A/B against
the product's default (``on``: on a side stream beside the router and the routed experts, forked and joined inside
each graph; :func:`~vexpert_runtime.serve.sparse_blocks.sparse_block_parts`).

``--kv-cache-dtype fp8``: the KV cache in FP8 (half its bytes; the bound counts them so), as ``vexpert serve
--kv-cache-dtype fp8`` keeps it — what it saves where the KV read matters, at long contexts.

Long contexts (split-KV, ``attention_kernels.kv_splits``): a checkpoint with a longer context, the same
batches at several contexts with the splits ``vexpert serve`` picks (``--kv-splits auto``, the row's
``kv_splits``) and with every launch one pass (``off``):

    python benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3-long --max-position-embeddings 163840 \
        --batches 1 4 16 --context 32768 --kv-splits auto|off
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from serve_engine import card_hbm_bytes_per_s, hbm_bound
from serve_load import block_fp8_copy, write_model

from vexpert_runtime.node.step_graph import step_stream
from vexpert_runtime.serve.demo_model import ensure_demo_model
from vexpert_runtime.serve.hf_model import HFStepModel
from vexpert_runtime.serve.kv_cache import BlockPool
from vexpert_runtime.serve.moe_executors import EPExperts, checkpoint_reader
from vexpert_runtime.serve.step import SamplingSpec, SequenceWork


def step_flops(model: HFStepModel, batch: int, context: int) -> int:
    """Matmul FLOPs of one decode step of ``batch`` tokens at ``context``: 2 × the parameters each token
    multiplies (every linear weight outside the routed experts, which it multiplies top-k of, and
    outside the embedding, which it only reads a row of) + MLA's absorbed attention (scores over C + R
    and the latent sum over C per head and context token; GQA: 2 × 2 · heads · d per context token)."""
    config = model.model.config
    per_token = 0
    counted: set[int] = set()  # storages counted whole: a fused projection's originals are views into it
    for name, param in sorted(model.model.named_parameters(), key=lambda item: -item[1].numel()):
        storage = param.untyped_storage()
        if param.dim() != 2 or "embed_tokens" in name or "norm" in name or storage.data_ptr() in counted:
            continue
        per_token += param.numel()
        if param.numel() * param.element_size() == storage.nbytes():
            counted.add(storage.data_ptr())
    experts = len(model.moe_layers) * int(config.num_experts_per_tok) * 3 * model.intermediate_size * int(config.hidden_size)
    heads = int(config.num_attention_heads)
    if getattr(config, "kv_lora_rank", None):
        width = 2 * int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    else:
        width = 2 * (getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    attention = int(config.num_hidden_layers) * heads * context * width
    return 2 * batch * (per_token + experts + attention)


def _tracked(sampling: str, context: int) -> int:
    """A penalized sequence's work names its prompt length (the model tracks its tokens): the decodes' context."""
    return context if sampling in ("penalties", "grammar") else -1


_HOST_TIMED = 5  # replays whose host time gives ``replay_host_ms``
# --sampling: what each sequence samples with (draw 1); top-p and top-k are the generation configs' defaults,
# logprobs a greedy request that asks for its tokens' log-probabilities (the graphs with log-softmax and top-20),
# penalties a greedy one with Qwen-MoE generation configs' repetition penalty (the graphs with the token tables)
SAMPLING = {"greedy": SamplingSpec(draw=1), "top-p": SamplingSpec(0.6, 0.95, draw=1),
            "top-k": SamplingSpec(0.6, 0.95, draw=1, top_k=20), "logprobs": SamplingSpec(draw=1, logprobs=True),
            "penalties": SamplingSpec(draw=1, repetition=1.05),
            "grammar": SamplingSpec(draw=1)}  # its allowed tokens are set once the vocabulary is known (main)


def kernel_times(graph: torch.cuda.CUDAGraph, iters: int, top: int = 25) -> dict[str, object]:
    """CUDA ms and launches per replay of each kernel name (profiler over ``iters`` replays): the ``top``
    largest, and the kernels' total (ms, count) per replay."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time / 1e3
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {"kernels_per_step": round(sum(n for _, n in totals.values()) / iters, 1),
            "kernel_ms_per_step": round(sum(ms for ms, _ in totals.values()) / iters, 4),
            "top": [(name[:90], round(ms / iters, 4), round(n / iters, 1)) for name, (ms, n) in ranked[:top]]}


def op_times(model: HFStepModel, work: list[SequenceWork], iters: int, top: int = 25) -> list[tuple[str, str, float]]:
    """The eager step's torch ops with their input shapes (profiler, ``record_shapes``): (op, shapes,
    CUDA ms per step) of the ``top`` largest — which GEMM a graph kernel's name stands for."""
    from torch.profiler import ProfilerActivity, profile

    model.step(work)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(iters):
            model.step(work)
        torch.cuda.synchronize()
    rows = [(e.key, str(e.input_shapes)[:160], e.self_device_time_total / 1e3 / iters)
            for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    return [(key, shapes, round(ms, 4)) for key, shapes, ms in rows[:top]]


def card_bound(step_bytes: int, graph_ms: float) -> dict[str, object]:
    """The step's bytes over the bandwidth of the card that ran it (beside ``bound_ms``, the H200's): its name, that
    bound and the graph's ratio to it — an H100's run says how far it is from its own card."""
    name = torch.cuda.get_device_name()
    rate = card_hbm_bytes_per_s(name)
    if rate is None:
        return {"card": name}
    own = 1000 * step_bytes / rate
    return {"card": name, "card_bound_ms": round(own, 3), "graph_over_card_bound": round(graph_ms / own, 2)}


def replayed_ms(model: HFStepModel, work: list[SequenceWork], stream: torch.cuda.Stream, iters: int) -> float:
    """GPU ms of ``work``'s bucket graph replayed back to back on the inputs its last launch copied."""
    for _ in range(3):
        model.step(work)
    torch.cuda.synchronize()
    graphs = model.graphs
    assert graphs is not None
    graph, _ = graphs.graphs[graphs.key_for(work)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(iters):
        graph.replay()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/bench-ds3"), help="written once, reused")
    parser.add_argument("--family", choices=("deepseek_v3", "qwen3_moe"), default="deepseek_v3",
                        help="the checkpoint written when --model-dir holds none: DeepSeek-V3's sizes, or Qwen3-30B-A3B's "
                             "(then pass --experts 128: its top-8 of 128)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--context", type=int, default=96, help="tokens each sequence holds")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200 SXM: 989)")
    parser.add_argument("--profile", action="store_true", help="kernel times of the graph replays (torch.profiler)")
    parser.add_argument("--top", type=int, default=25, help="kernels (and ops) listed by --profile / --profile-ops")
    parser.add_argument("--profile-ops", action="store_true",
                        help="before the graphs: the eager step's ops with input shapes at the largest batch")
    parser.add_argument("--prefill-chunks", type=int, nargs="*", default=[],
                        help="per batch, also the decodes + this many prompt chunks in one iteration")
    parser.add_argument("--chunk", type=int, default=62, help="tokens per prompt chunk")
    parser.add_argument("--max-position-embeddings", type=int, default=4096,
                        help="the written checkpoint's context (a --context beyond 4096 needs a longer one)")
    parser.add_argument("--kv-splits", choices=("auto", "off"), default="auto",
                        help="split-KV for long contexts as served (auto), or every launch one pass (off)")
    parser.add_argument("--sampling", choices=sorted(SAMPLING), nargs="+", default=["greedy"],
                        help="how every sequence samples (each in turn, one model load): greedy, or the generation-config defaults of DeepSeek-V3 "
                             "(top-p 0.95) / Qwen3 (top-k 20, top-p 0.95), whose graphs sort the vocabulary, or "
                             "greedy with log-probabilities (logprobs) or a repetition penalty (penalties)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="auto",
                        help="the KV cache's dtype, as vexpert serve --kv-cache-dtype (the bound's KV bytes follow it)")
    parser.add_argument("--shared-expert-stream", choices=("on", "off"), default="on",
                        help="the shared experts on a side stream beside the routed ones (the product's default), or not")
    parser.add_argument("--stream-priority", type=int, default=None,
                        help="the step stream's CUDA priority (default: the worker's, step_graph.STEP_STREAM_PRIORITY = -1; "
                             "negative is higher): 0 puts it level with the shared experts' side stream (priority 0)")
    parser.add_argument("--block-fp8", action="store_true",
                        help="the checkpoint's block-FP8 copy (DeepSeek-V3's released format), loaded as a serving rank "
                             "loads it: experts FP8 rows read in place, the rest dequantised to bf16 (the bound counts so)")
    parser.add_argument("--linear-format", choices=("dense", "fp8_block"), default="dense",
                        help="with --block-fp8: the other linear layers dequantised at load or kept FP8 (vexpert serve "
                             "--linear-format; the bound counts their bytes as served)")
    parser.add_argument("--expert-compute", choices=("w8a16", "w8a8"), default="w8a16",
                        help="with --block-fp8: the FP8 rows against bf16 activations or FP8 ones (vexpert serve "
                             "--expert-compute)")
    parser.add_argument("--ncu-range", action="store_true",
                        help="after each row, one more replay inside the NVTX range ncu_step_<batch> (for Nsight "
                             "Compute's --nvtx-include: benchmarks/ncu_stalls.sh step)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (args.model_dir / "config.json").exists():
        write_model(args.model_dir, ensure_demo_model(Path("/tmp/vexpert-demo-model")), args.layers, args.experts,
                    small=False, device="cuda", positions=args.max_position_embeddings, family=args.family)
    if args.block_fp8:
        args.model_dir = block_fp8_copy(args.model_dir)
    max_seqs = max(args.batches) + max(args.prefill_chunks, default=0)
    # block FP8: as serve/rank.py builds a rank (experts read from the shards as FP8 rows); else the experts
    # the model loaded, moved into the EP layer
    reader = checkpoint_reader(args.model_dir, "auto", args.expert_compute) if args.block_fp8 else None
    executor = None if reader is None else EPExperts.from_checkpoint(
        reader, reader.spec.num_layers, torch.bfloat16, 0, 1, None, "cuda", max_tokens=args.max_batch_tokens)
    model = HFStepModel(args.model_dir, device="cuda", dtype=torch.bfloat16,
                        kv_cache_tokens=max_seqs * (max(args.context, args.chunk) + 32),
                        overlap_shared_experts=args.shared_expert_stream == "on", kv_cache_dtype=args.kv_cache_dtype,
                        load_experts=executor is None, executor=executor,
                        fp8_linears=args.block_fp8 and args.linear_format == "fp8_block",
                        fp8_activations=args.block_fp8 and args.expert_compute == "w8a8")
    if executor is None:
        model.executor = EPExperts.for_model(model, 0, 1, None, max_tokens=args.max_batch_tokens)
    # structured output: every other token allowed (bits 0x55555555), a new mask written into every row's bias
    # ahead of each launch, as a constrained sequence's is (launch_span_ms holds that; graph_ms does not)
    SAMPLING["grammar"].allowed = torch.full(((model.vocab_size + 31) // 32,), 0x55555555, dtype=torch.int32)
    model.drop_expert_weights()
    stream = step_stream() if args.stream_priority is None else torch.cuda.Stream(priority=args.stream_priority)
    results = []
    ops = None
    with torch.cuda.stream(stream):
        model.compile_pieces()
        if args.profile_ops:
            pool = BlockPool(model.kv_num_blocks, model.kv_block_size)
            for seq in range(max_seqs):
                pool.add(seq)
            work = [SequenceWork(seq, (seq % 100 + 3,), args.context, tuple(pool.grow(seq, args.context + 1)),
                                 SAMPLING[args.sampling[0]], penalty_prompt_len=_tracked(args.sampling[0], args.context))
                    for seq in range(max_seqs)]
            ops = op_times(model, work, 5, args.top)
            for op in ops:
                print("op", json.dumps(op), flush=True)
        model.enable_cuda_graphs(args.max_batch_tokens, max_seqs, stream)
        assert model.graphs is not None
        if args.kv_splits == "off":
            model.graphs.kv_splits = None
        pool = BlockPool(model.kv_num_blocks, model.kv_block_size)
        for seq in range(max_seqs):
            pool.add(seq)
        blocks = [tuple(pool.grow(seq, args.context + 1)) for seq in range(max_seqs)]
        for sampling, batch in itertools.product(args.sampling, args.batches):
            sample, tracked = SAMPLING[sampling], _tracked(sampling, args.context)
            for chunks in args.prefill_chunks:
                work = [SequenceWork(seq, (seq % 100 + 3,), args.context, blocks[seq], sample, penalty_prompt_len=tracked)
                        for seq in range(batch)]
                work += [SequenceWork(seq, tuple(range(3, 3 + args.chunk)), 0, blocks[seq], sample,
                                      penalty_prompt_len=tracked)
                         for seq in range(batch, batch + chunks)]
                tokens = batch + chunks * args.chunk
                if tokens > args.max_batch_tokens:
                    print(f"skipped: {batch} decodes + {chunks} chunks = {tokens} tokens > --max-batch-tokens")
                    continue
                row = {"batch": batch, "prefill_chunks": chunks, "tokens": tokens,
                       "graph_ms": round(replayed_ms(model, work, stream, args.iters), 3)}
                print(json.dumps(row), flush=True)
                results.append(row)
            work = [SequenceWork(seq, (seq % 100 + 3,), args.context, blocks[seq], sample, penalty_prompt_len=tracked)
                    for seq in range(batch)]
            for _ in range(5):
                model.step(work)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host = time.perf_counter()
            start.record(stream)
            for _ in range(args.iters):
                model.launch(work)
            end.record(stream)
            host_ms = (time.perf_counter() - host) / args.iters * 1e3
            end.synchronize()
            step_ms = start.elapsed_time(end) / args.iters
            # The graph alone: its replays back to back on the inputs the last launch copied (no host work
            # between them), i.e. the GPU's time for the step.
            graphs = model.graphs
            assert graphs is not None
            graph, _ = graphs.graphs[graphs.key_for(work)]
            start.record(stream)
            host = time.perf_counter()
            for _ in range(_HOST_TIMED):  # the host's cost of one launch (too few to fill the launch queue)
                graph.replay()
            replay_host_ms = (time.perf_counter() - host) / _HOST_TIMED * 1e3
            for _ in range(args.iters - _HOST_TIMED):
                graph.replay()
            end.record(stream)
            end.synchronize()
            graph_ms = start.elapsed_time(end) / args.iters
            bound = hbm_bound(args.model_dir, batch, args.context, model.kv_dtype,
                              fp8_linears=args.block_fp8 and args.linear_format == "fp8_block")
            flops = step_flops(model, batch, args.context)
            row = {"batch": batch, "context": args.context, "sampling": sampling,
                   "shared_expert_stream": args.shared_expert_stream, "stream_priority": stream.priority,
                   "kv_cache_dtype": args.kv_cache_dtype,
                   "experts": "block_fp8" if args.block_fp8 else "bf16",
                   "expert_compute": args.expert_compute if args.block_fp8 else "bf16",
                   "linear_format": args.linear_format if args.block_fp8 else "dense",
                   "kv_splits": graphs.key_for(work)[2],
                   "graph_ms": round(graph_ms, 3),
                   "launch_span_ms": round(step_ms, 3), "host_launch_ms": round(host_ms, 3),
                   "replay_host_ms": round(replay_host_ms, 3),
                   "bound_ms": bound["bound_ms"], "graph_over_bound": round(graph_ms / bound["bound_ms"], 2),
                   **card_bound(bound["bytes"], graph_ms),
                   "bytes": bound["bytes"], "flops": flops,
                   "flop_ms": round(flops / (args.peak_tflops * 1e12) * 1e3, 3)}
            if args.profile:
                row["kernels"] = kernel_times(graph, args.iters, args.top)
            if args.ncu_range:
                with torch.cuda.nvtx.range(f"ncu_step_{batch}"):
                    graph.replay()
                torch.cuda.synchronize()
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "rows": results, "eager_ops": ops}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
