"""Issue #21: the serving engine at GPU speed — ``vexpert serve`` against transformers ``generate``.

One GPU, one EP rank (no host staging), the checkpoint of :mod:`serve_load` (random-weight
DeepSeek-V3 with its real expert and MLA sizes: H 7168, expert I 2048, ``--layers`` MoE layers ×
``--experts`` experts, top-2, one shared expert, routers skewed by a real DeepSeek-V3 load), the demo
tokenizer, ~62-token prompts, ``--max-tokens`` new tokens each.

* ``hf``: transformers' own ``generate`` on the same checkpoint and GPU (bf16, sdpa, greedy, one padded
  batch of N identical prompts, ``min_new_tokens`` = ``max_new_tokens``): output tokens / wall time of
  the call, after one warm-up call.
* ``vexpert`` / ``static``: ``vexpert serve`` (API process, coordinator, one worker) under N closed-loop
  streaming clients (:func:`serve_load.load`), τ = 0.95 / τ = 0 (static placement, nothing streamed).
* ``--profile-streams N``: a torch-profiler trace of iterations ``--profile-iters`` of the worker at N
  streams (``VEXPERT_PROFILE``), summarised per iteration: wall time, GPU busy share (union of kernel
  and copy intervals / iteration span), host launches (kernel launches, graph launches, async copies).
* the HBM bound of a decode step at N streams: bytes the step must read (every non-embedding weight,
  the experts all hit, the embedding rows of the batch, the KV cache at the mean context) ÷ 4.8 TB/s.

    python benchmarks/serve_engine.py --out benchmarks/results/serve_engine --model-dir .cache/bench-ds3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from serve_load import block_fp8_copy, load_processes, scrape, wait_healthy, write_model

from vexpert_runtime.ports import free_port
from vexpert_runtime.serve.demo_model import ensure_demo_model
from vexpert_runtime.serve.moe_executors import EP_LAYER_RANGE

HBM_BYTES_PER_S = 4.8e12  # H200: issue #21's yardstick, whatever card ran
# The card that ran, by the name torch reports: its own HBM bandwidth (datasheet), for a second, card-own ratio
CARD_HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))


def card_hbm_bytes_per_s(name: str) -> float | None:
    """The datasheet HBM bandwidth of the GPU called ``name`` (``torch.cuda.get_device_name``), None if not listed."""
    return next((rate for key, rate in CARD_HBM_BYTES_PER_S if key in name), None)
PROMPT_TOKENS = 62
TEXT = ("A mixture of experts model sends every token to a few of its many expert networks, and expert "
        "parallelism spreads those experts over GPUs, so a hot expert makes one GPU the straggler. ") * 4


def prompt_text(model_dir: Path) -> tuple[str, list[int]]:
    """A prompt of about PROMPT_TOKENS tokens and its ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:PROMPT_TOKENS]
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text, add_special_tokens=False)


def distinct_prompts(model_dir: Path, prompt_ids: list[int], count: int, shared: int) -> list[str]:
    """``count`` prompts as long as ``prompt_ids``, the first ``shared`` ids theirs, the rest different in
    each (random word ids, seeded): a system prompt followed by each user's text, for prefix caching."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rng = random.Random(0)
    words = tokenizer.encode(TEXT, add_special_tokens=False)
    return [str(tokenizer.decode(prompt_ids[:shared] + [rng.choice(words) for _ in range(len(prompt_ids) - shared)]))
            for _ in range(count)]


def hf_generate(model_dir: Path, streams: list[int], prompt_ids: list[int], new_tokens: int,
                variants: list[str]) -> dict[str, Any]:
    """transformers ``generate`` per variant ``attention:cache`` (e.g. ``sdpa:dynamic``, ``eager:dynamic``,
    ``sdpa:static``); experts run transformers' default (``grouped_mm`` where it dispatches)."""
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {}
    for variant in variants:
        attention, _, cache = variant.partition(":")
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.bfloat16,
                                                          attn_implementation=attention)
        model = model.to("cuda").eval()
        rows: dict[str, Any] = {"experts_implementation": getattr(model.config, "_experts_implementation", None)}
        for batch in streams:
            ids = torch.tensor([prompt_ids] * batch, device="cuda")
            mask = torch.ones_like(ids)

            def run(n: int, ids: torch.Tensor = ids, mask: torch.Tensor = mask, model: Any = model,
                    cache: str = cache) -> float:
                extra = {"cache_implementation": cache} if cache and cache != "dynamic" else {}
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.inference_mode():
                    model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                   pad_token_id=0, **extra)
                torch.cuda.synchronize()
                return time.perf_counter() - start

            try:
                run(4)
                elapsed = run(new_tokens)
                rows[str(batch)] = {"tokens_per_s": round(batch * new_tokens / elapsed, 1),
                                    "seconds": round(elapsed, 3)}
            except Exception as exc:  # a variant that does not run is reported, not fatal
                rows[str(batch)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print("hf", variant, batch, rows[str(batch)], flush=True)
        out[variant] = rows
        model = None  # free it before the next variant and the servers
        torch.cuda.empty_cache()
    best = {str(b): max((r[str(b)].get("tokens_per_s", 0.0) for r in out.values()), default=0.0) for b in streams}
    out["best_tokens_per_s"] = best
    return out


def hbm_bound(model_dir: Path, batch: int, mean_context: float, kv_dtype: torch.dtype = torch.bfloat16,
              fp8_linears: bool = False) -> dict[str, Any]:
    """Bytes one decode step of ``batch`` sequences must read, and that ÷ HBM bandwidth (the KV cache in
    ``kv_dtype``: ``--kv-cache-dtype fp8`` halves its bytes). Weights count as served: bf16, except a block-FP8
    checkpoint's routed experts, which stay FP8 (a byte per weight, plus their float32 block scales); its other
    projections are dequantised to bf16 at load, so their scales are never read — unless ``fp8_linears``
    (``--linear-format fp8_block``): then they too count as stored, but MLA's kv_b_proj (kept dense)."""
    from safetensors import safe_open

    from vexpert_runtime.serve.attention_layers import kv_layout

    weights = embed = 0
    hidden = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  # safe_open is not a mapping
                tensor = handle.get_slice(name)
                shape = tensor.get_shape()
                numel = 1
                for n in shape:
                    numel *= n
                stays_fp8 = ".experts." in name or (fp8_linears and "kv_b_proj" not in name)  # (if stored so)
                if name.endswith("_scale_inv"):
                    nbytes = numel * 4 if stays_fp8 else 0
                elif tensor.get_dtype() == "F8_E4M3" and stays_fp8:
                    nbytes = numel
                else:
                    nbytes = numel * 2  # served in bf16
                if "embed_tokens" in name:
                    embed += nbytes
                    hidden = shape[1]
                else:
                    weights += nbytes
    from transformers import AutoConfig

    layout = kv_layout(AutoConfig.from_pretrained(str(model_dir), local_files_only=True))
    kv = int(batch * mean_context * layout.token_bytes(kv_dtype))
    total = weights + batch * hidden * 2 + kv
    return {"batch": batch, "weight_bytes": weights, "kv_bytes": kv, "embedding_rows_bytes": batch * hidden * 2,
            "bytes": total, "bound_ms": round(1000 * total / HBM_BYTES_PER_S, 3)}


def write_config(path: Path, checkpoint: Path, tau: float, profile: dict[str, Any] | None, k: int,
                 ranks: int = 1) -> Path:
    """``ranks`` EP ranks: one per GPU, or (more ranks than GPUs) workers sharing the GPU."""
    gpus = torch.cuda.device_count()
    raw: dict[str, Any] = {
        "model": {"checkpoint_path": str(checkpoint), "dtype": "bfloat16"},
        "parallelism": {"expert_parallel_size": ranks, "gpus_per_node": ranks, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": tau},
        "tuning": {"allocation_interval": k},
        "runtime": {"device": "cuda", "metrics_port": 0, "slot_fill_timeout_s": 60.0,
                    "workers_per_gpu": ranks if gpus < ranks else 1},
    }
    if profile is not None:
        raw["profile"] = profile
    path.write_text(yaml.safe_dump(raw))
    return path


def serve(config: Path, model: Path, streams: int, prompt: str | list[str], args: argparse.Namespace, log: Path,
          trace_dir: Path | None) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vexpert_runtime", "serve", "--config", str(config), "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
           "--max-batch-tokens", str(args.max_batch_tokens), "--max-running", str(max(streams, 16)),
           "--max-waiting", str(2 * streams), "--drain-timeout", "5", "--compile", args.compile,
           *shlex.split(args.serve_args)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "runtime"),
                                                        os.environ.get("PYTHONPATH", "")])}
    if trace_dir is not None:
        env["VEXPERT_PROFILE"] = f"{args.profile_iters}:{trace_dir}"
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(proc, url, log, started, 300)
        healthy = time.perf_counter()
        # before the window (a rank captures its graphs before /health answers)
        first_request(url, prompt if isinstance(prompt, str) else prompt[0])
        first = time.perf_counter()
        before = scrape(url)
        sampler = host_sampler(proc.pid, args, log.with_suffix(".pyspy.txt"))
        result = load_processes(url, prompt, streams, args.duration, args.warmup, args.max_tokens, args.client_processes)
        if sampler is not None:
            sampler.wait(60)
            result["host_profile"] = summarise_host_profile(log.with_suffix(".pyspy.txt"))
        result["healthy_s"] = round(healthy - started, 1)  # start → /health 200 (graphs captured, compiled)
        result["first_request_s"] = round(first - healthy, 2)  # one 4-token completion sent at /health
        result["startup_s"] = round(time.perf_counter() - started, 1)  # the whole run: start, load, profile
        result["metrics"] = scrape(url)
        # seconds in Python's cyclic collector during the load (the start-up's freeze excluded), by generation
        result["gc_s_during_load"] = {k: round(v - before.get(k, 0.0), 4) for k, v in result["metrics"].items()
                                      if "_gc_seconds_total" in k}
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def first_request(url: str, prompt: str, timeout_s: float = 400.0) -> None:
    """One completion, waited for: the rank captures its CUDA graphs (compiling the fused pieces the
    first time) at its first iteration, which the measured window should not include."""
    import urllib.request

    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        response.read()


def host_sampler(pid: int, args: argparse.Namespace, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy sampling the server's processes (Python stacks, without pausing them) for ``--pyspy``
    seconds of the measured window, or None (not asked for, or py-spy absent)."""
    if not args.pyspy:
        return None
    exe = os.environ.get("PYSPY") or shutil.which("py-spy")
    if exe is None:
        print("py-spy not found (PATH or $PYSPY): no host profile", file=sys.stderr)
        return None
    idle = "--idle " if args.pyspy_idle else ""  # waits too (sleeping, blocked on a lock or the GPU)
    command = (f"sleep {args.warmup + 1}; exec {exe} record --pid {pid} --subprocesses --nonblocking --function --threads "
               f"--rate 500 {idle}"
               f"--format raw --duration {int(args.pyspy)} -o {out}")
    return subprocess.Popen(["bash", "-c", command], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def summarise_host_profile(path: Path, top: int = 40) -> dict[str, Any]:
    """Per process and thread, the functions with the most samples on the stack (inclusive) and on top
    (self), from py-spy's raw (collapsed) output: ``process …;thread (tid): name;frame;… count`` lines
    (key: the pid and the thread; a worker's serving loop is the thread whose frames include ``_loop``)."""
    if not path.exists():
        return {}
    inclusive: dict[str, dict[str, int]] = {}
    own: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # --subprocesses nests a child's frames under its parent's: "process <root>:…;process <child>:…;thread …"
        # (a command line may hold ";": only frames that start a process or thread count as such)
        heads = [i for i, f in enumerate(frames) if f.startswith("process ") and f.partition(":")[0][8:].isdigit()]
        at = heads[-1] if heads else 0
        process = frames[at].partition(":")[0]
        body = [f for f in frames[at + 1:] if not f.startswith(" spawn_main")]
        if body and body[0].startswith("thread "):
            process, body = f"{process} {body[0]}", body[1:]
        n = int(count)
        totals[process] = totals.get(process, 0) + n
        seen = set()
        for frame in body:
            if frame not in seen:
                seen.add(frame)
                inclusive.setdefault(process, {})[frame] = inclusive.setdefault(process, {}).get(frame, 0) + n
        if body:
            own.setdefault(process, {})[body[-1]] = own.setdefault(process, {}).get(body[-1], 0) + n

    def ranked(table: dict[str, int], total: int) -> list[tuple[str, float]]:
        return [(name, round(n / total, 3)) for name, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]]

    return {process: {"samples": total, "inclusive": ranked(inclusive.get(process, {}), total),
                      "self": ranked(own.get(process, {}), total)} for process, total in totals.items()}


_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
             "cudaMemcpyAsync", "cudaMemsetAsync", "cuStreamWaitValue32", "cuStreamWriteValue32")


def summarise_trace(path: Path) -> dict[str, Any]:
    """Per iteration, over one trace of consecutive iterations (``worker<r>-iterations<a>-<b>.json``):
    wall time, GPU busy time and share (union of kernels and copies), host launches."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    first, _, last = path.stem.rpartition("iterations")[2].partition("-")
    iterations = int(last or first) - int(first) + 1 if first.isdigit() else 1
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    busy, cursor = 0.0, start
    for a, b in gpu:
        a = max(a, cursor)
        if b > a:
            busy += b - a
            cursor = b
    launches: dict[str, int] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in _LAUNCHES:
            launches[e["name"]] = launches.get(e["name"], 0) + 1
    names = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    by_kernel: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "kernel":
            entry = by_kernel.setdefault(e["name"][:80], [0, 0.0])
            entry[0] += 1
            entry[1] += e["dur"]
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:15]
    wall = end - start
    ep_ms = ep_layer_gpu_ms(events)
    return {"file": path.name, "iterations": iterations, "wall_ms_per_iteration": round(wall / 1000 / iterations, 3),
            "gpu_busy_ms_per_iteration": round(busy / 1000 / iterations, 3),
            "gpu_busy_share": round(busy / max(1.0, wall), 3),
            "host_launches_per_iteration": round(sum(launches.values()) / iterations, 2),
            "launches": launches, "graph_replays": launches.get("cudaGraphLaunch", 0),
            "gpu_kernels_per_iteration": round(sum(1 for e in events if e.get("cat") == "kernel") / iterations, 1),
            "cpu_ops": len(names),
            "top_kernels_us_per_iteration": [[name, round(n / iterations, 1), round(us / iterations, 1)]
                                             for name, (n, us) in top],
            "ep_layer_gpu_ms_per_iteration": None if ep_ms is None else round(ep_ms / iterations, 3),
            "ep_layer_share_of_gpu_busy": None if ep_ms is None or not busy else round(ep_ms * 1000 / busy, 3)}


def ep_layer_gpu_ms(events: list[dict[str, Any]]) -> float | None:
    """GPU time of the kernels launched inside the EP layer's profiler ranges (``EP_LAYER_RANGE``,
    eager steps; a graph replay has no per-layer ranges): None where the trace has none. A kernel is
    matched to its launch by the correlation id, the launch to a range on the same thread by time."""
    ranges: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
        if e["name"] == EP_LAYER_RANGE and e.get("cat") in ("user_annotation", "cpu_op"):
            ranges.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"]))
    if not ranges:
        return None
    inside = set()
    for e in events:
        launch = e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
        if launch and any(a <= e["ts"] <= b for a, b in ranges.get(e.get("tid"), ())):
            inside.add(e["args"]["correlation"])
    return sum(e["dur"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and e.get("args", {}).get("correlation") in inside) / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/bench-ds3"), help="written once, reused")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--max-position-embeddings", type=int, default=4096,
                        help="the checkpoint's context when it is written (the release's: 163840; a new --model-dir)")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--duration", type=float, default=25.0)
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--profile", type=Path, default=None, help="calibrated PerformanceProfile JSON")
    parser.add_argument("--modes", nargs="+", default=["hf", "vexpert"], help="hf, vexpert, static")
    parser.add_argument("--onoff-streams", type=int, nargs="*", default=[], help="streams to run static at too")
    parser.add_argument("--ranks", type=int, default=1, help="EP ranks (more than GPUs: workers share a GPU)")
    parser.add_argument("--hf-variants", nargs="+", default=["sdpa:dynamic", "eager:dynamic", "sdpa:static"])
    parser.add_argument("--profile-streams", type=int, nargs="*", default=[])
    parser.add_argument("--profile-iters", default="600-619", help="one trace over these iterations")
    parser.add_argument("--pyspy", type=float, default=0.0, help="seconds of py-spy host sampling per serve run")
    parser.add_argument("--pyspy-idle", action="store_true", help="py-spy samples idle threads too (--idle)")
    parser.add_argument("--client-processes", type=int, default=1, help="load generator processes (streams split)")
    parser.add_argument("--serve-args", default="",
                        help="more vexpert serve arguments, one shell string, e.g. '--api-servers 4' (results go "
                             "under '<mode>_<--tag>')")
    parser.add_argument("--tag", default="", help="suffix of the results' key for this configuration")
    parser.add_argument("--distinct-prompts", type=int, default=0,
                        help="N different prompts (the requests take them in turn) instead of one for all: with "
                             "--prefix-caching, one prompt for all is its best case")
    parser.add_argument("--shared-prefix-tokens", type=int, default=0,
                        help="with --distinct-prompts: the first N prompt ids the same in all (a system prompt)")
    parser.add_argument("--block-fp8", action="store_true",
                        help="serve the checkpoint's block-FP8 copy (DeepSeek-V3's released format, written once next "
                             "to it: experts served FP8); transformers' generate runs the bf16 original")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="vexpert serve --compile (results of 'off' go under '<mode>_compile-off')")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    results: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    results.update({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers,
                    "experts": args.experts, "max_tokens": args.max_tokens, "prompt_tokens": PROMPT_TOKENS})
    if not (args.model_dir / "config.json").exists():
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="vexpert-tok-") as tmp:
            write_model(args.model_dir, ensure_demo_model(Path(tmp) / "demo"), args.layers, args.experts, False, "cuda",
                        args.max_position_embeddings)
        results["model_write_s"] = round(time.perf_counter() - started, 1)
    hf_dir = args.model_dir
    if args.block_fp8:
        started = time.perf_counter()
        args.model_dir = block_fp8_copy(args.model_dir)
        results["block_fp8_copy_s"] = round(time.perf_counter() - started, 1)
        results["served_checkpoint"] = str(args.model_dir)
    results["max_position_embeddings"] = json.loads((args.model_dir / "config.json").read_text())["max_position_embeddings"]
    prompt, prompt_ids = prompt_text(args.model_dir)
    results["prompt_ids"] = len(prompt_ids)
    served_prompts: str | list[str] = prompt
    if args.distinct_prompts:
        served_prompts = distinct_prompts(args.model_dir, prompt_ids, args.distinct_prompts, args.shared_prefix_tokens)

    def save() -> None:
        summary_path.write_text(json.dumps(results, indent=2))

    if "hf" in args.modes:
        results["hf"] = hf_generate(hf_dir, args.streams, prompt_ids, args.max_tokens, args.hf_variants)
        save()
    profile = json.loads(args.profile.read_text()) if args.profile else None
    for streams in args.streams:
        results.setdefault("hbm_bound", {})[str(streams)] = hbm_bound(args.model_dir, streams,
                                                                      len(prompt_ids) + args.max_tokens / 2)
        modes = [m for m in ("vexpert", "static") if m in args.modes or (m == "static" and streams in args.onoff_streams)]
        for mode in modes:
            tag = ("" if args.compile == "auto" else f"_compile-{args.compile}") + (f"_{args.tag}" if args.tag else "")
            trace_dir = args.out / f"trace_{mode}{tag}_{streams}" if streams in args.profile_streams else None
            config = write_config(args.out / f"{mode}.yaml", args.model_dir, 0.95 if mode == "vexpert" else 0.0,
                                  profile, args.k, args.ranks)
            result = serve(config, args.model_dir, streams, served_prompts, args,
                           args.out / f"server_{mode}{tag}_{streams}_r{args.ranks}.log", trace_dir)
            result["ranks"] = args.ranks
            if trace_dir is not None and trace_dir.exists():
                result["trace"] = [summarise_trace(p) for p in sorted(trace_dir.glob("*.json"))]
            key = (mode if args.ranks == 1 else f"{mode}_r{args.ranks}") + ("" if args.compile == "auto" else
                                                                             f"_compile-{args.compile}")
            if args.tag:
                key += f"_{args.tag}"
            result["serve_args"] = args.serve_args
            result["prompts"] = {"distinct": args.distinct_prompts or 1, "shared_prefix_tokens":
                                 args.shared_prefix_tokens if args.distinct_prompts else len(prompt_ids)}
            results.setdefault(key, {})[str(streams)] = result
            print(mode, streams, json.dumps(result), flush=True)
            save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
