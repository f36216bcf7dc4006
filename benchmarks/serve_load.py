"""Issue #13: ``vexpert serve`` under load — requests/s, tokens/s, time to first token and inter-token
latency, with vExpert streaming on and off.

The model: transformers' DeepSeek-V3 with random weights and DeepSeek-V3-sized experts (H = 7168,
I = 2048, MLA as in the release) but few layers and experts, its routers skewed by a bundled real
DeepSeek-V3 load (:func:`vexpert_runtime.serve.demo_model.real_load_bias`), the demo tokenizer. The
server: ``vexpert serve`` itself (coordinator, 2 EP ranks — two GPUs, or two workers sharing one GPU —
the allocator every k iterations), started as a process per mode:

* ``vexpert``: τ = 0.95 (layers below it get vExperts), the given calibrated profile;
* ``static``: τ = 0 (no layer gets vExperts: the static EP placement, nothing streamed).

The load: ``--concurrency`` clients, each sending streaming completions back to back for
``--duration`` seconds (prompt ≈ 64 tokens, ``max_tokens`` 64, ``ignore_eos``); the first
``--warmup`` seconds are not counted.

    python benchmarks/serve_load.py --out benchmarks/results/serve_load \\
        --profile benchmarks/results/calibration/profile_h200_deepseek_v3.json      # GPU host
    python benchmarks/serve_load.py --cpu --small --duration 20 --out /tmp/sl        # CPU twin (shapes only)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.ports import free_port
from vexpert_runtime.serve.demo_model import ensure_demo_model, real_load_bias

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_model(directory: Path, tokenizer_dir: Path, layers: int, experts: int, small: bool, device: str,
                positions: int = 4096, family: str = "deepseek_v3") -> Path:
    """Random-weight DeepSeek-V3 (DeepSeek-V3-sized experts unless ``small``) + the demo tokenizer;
    ``positions``: its max_position_embeddings (the release's is 163,840). ``family="qwen3_moe"``: a Qwen3-MoE at
    Qwen3-30B-A3B's sizes (hidden 2048, 32 query heads and 4 KV heads of 128, experts of 768, top-8 of ``experts``),
    its routers random (no load bias to set: Qwen's routers have none)."""
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if family == "qwen3_moe":
        return _write_qwen3_moe(directory, len(tokenizer), layers, experts, device, positions, tokenizer)
    if family != "deepseek_v3":
        raise ValueError(f"write_model writes deepseek_v3 or qwen3_moe, not {family!r}")
    shape: dict[str, Any] = (
        {"hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
         "q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
        if small else
        {"hidden_size": 7168, "moe_intermediate_size": 2048, "intermediate_size": 18432, "num_attention_heads": 128,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
    )
    config = DeepseekV3Config(
        **shape, vocab_size=len(tokenizer), num_hidden_layers=layers, first_k_dense_replace=0,
        num_key_value_heads=shape["num_attention_heads"], n_routed_experts=experts, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=positions,
        initializer_range=0.02, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    skew = real_load_bias(layers, experts)
    for layer, bias in zip(model.model.layers, skew, strict=True):
        layer.mlp.gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
    model.save_pretrained(str(directory))
    del model
    return directory


def _write_qwen3_moe(directory: Path, vocab: int, layers: int, experts: int, device: str, positions: int,
                     tokenizer: Any) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    sizes: dict[str, Any] = dict(  # (a dict: mypy reads Qwen3MoeConfig's signature without head_dim, which it takes)
        vocab_size=vocab, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=experts,
        num_experts_per_tok=min(8, experts), norm_topk_prob=True, max_position_embeddings=positions,
        initializer_range=0.02, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config = Qwen3MoeConfig(**sizes)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(directory))
    del model
    return directory


def block_fp8_copy(src: Path, block: tuple[int, int] = (128, 128), device: str = "cuda") -> Path:
    """``<src>-fp8``, written once: checkpoint ``src`` in DeepSeek-V3's released format — every linear projection
    (``*_proj.weight``, ``kv_a_proj_with_mqa.weight``) F8_E4M3 with F32 ``weight_scale_inv`` of ``block`` tiles,
    ``quantization_config`` in config.json; routers, norms, embeddings and the LM head as they were. What
    ``vexpert serve`` reads from a real DeepSeek-V3 checkpoint: experts kept FP8, the rest dequantised at load."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vexpert_runtime.model.expert_format import quantize_fp8_block

    dst = src.with_name(src.name + "-fp8")
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.is_file() and file.name != "config.json":
            shutil.copy(file, tmp / file.name)
    for file in sorted(src.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device=device) as handle:
            for name in handle.keys():  # noqa: SIM118  # safe_open is not a mapping
                tensor = handle.get_tensor(name)
                if name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight")):
                    weight, scale = quantize_fp8_block(tensor, block)
                    tensors[name], tensors[name + "_scale_inv"] = weight.cpu(), scale.cpu()
                else:
                    tensors[name] = tensor.cpu()
        save_file(tensors, str(tmp / file.name), metadata={"format": "pt"})
        del tensors
    index = src / "model.safetensors.index.json"
    if index.exists():  # the shards' index names the scales too
        data = json.loads(index.read_text())
        data["weight_map"].update({f"{n}_scale_inv": f for n, f in list(data["weight_map"].items())
                                   if n.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight"))})
        (tmp / index.name).write_text(json.dumps(data))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                     "activation_scheme": "dynamic"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(dst)
    return dst


def write_config(path: Path, checkpoint: Path, device: str, tau: float, profile: dict[str, Any] | None, k: int) -> Path:
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    raw: dict[str, Any] = {
        "model": {"checkpoint_path": str(checkpoint), "dtype": "bfloat16" if device == "cuda" else "float32"},
        "parallelism": {"expert_parallel_size": 2, "gpus_per_node": 2, "master_port": free_port()},
        "vexpert": {"group_size": 2, "vmax": 1, "balance_threshold": tau},
        "tuning": {"allocation_interval": k},
        "runtime": {"device": device, "cpu_workers": 2 if device == "cpu" else 0, "metrics_port": 0,
                    "slot_fill_timeout_s": 60.0, "workers_per_gpu": 2 if device == "cuda" and gpus < 2 else 1},
    }
    if profile is not None:
        raw["profile"] = profile
    path.write_text(yaml.safe_dump(raw))
    return path


async def load_samples(url: str, prompt: str | list[str], concurrency: int, duration: float, warmup: float,
                       max_tokens: int, pool_limit: int = 0) -> dict[str, Any]:
    """Closed-loop streaming clients; per request TTFT and the gaps between chunks that carry text
(a token that ends inside a UTF-8 character carries none), tokens from ``usage`` (after warm-up):
the raw samples (:func:`summarise_load` makes the figures). ``prompt``: one for every request, or a
list the requests take in turn."""
    import aiohttp

    prompts = [prompt] if isinstance(prompt, str) else prompt
    sent_count = 0

    start = time.perf_counter()
    stop_at, count_from = start + duration, start + warmup
    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    done = tokens = errors = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done, tokens, errors, sent_count
        body = {"model": "bench", "prompt": prompts[0], "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        while time.perf_counter() < stop_at:
            body["prompt"] = prompts[sent_count % len(prompts)]
            sent_count += 1
            sent = time.perf_counter()
            stamps: list[float] = []
            generated = 0
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    errors += 1
                    await asyncio.sleep(0.1)
                    continue
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0].get("text"):
                            stamps.append(time.perf_counter())
                        if chunk.get("usage"):
                            generated = chunk["usage"]["completion_tokens"]
            if sent >= count_from and stamps:
                done += 1
                tokens += generated
                ttft.append(stamps[0] - sent)
                itl.extend(b - a for a, b in itertools.pairwise(stamps))
                if generated > 1:  # vLLM's TPOT: a request's time after its first token per token after it
                    tpot.append((stamps[-1] - stamps[0]) / (generated - 1))

    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    # 0: no pool cap, every client its own connection (aiohttp's default, 100, held "256 streams" to ~100)
    connector = aiohttp.TCPConnector(limit=pool_limit)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return {"requests": done, "errors": errors, "tokens": tokens, "measured_s": time.perf_counter() - count_from,
            "ttft": ttft, "itl": itl, "tpot": tpot}


def summarise_load(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one or more :func:`load_samples` runs over the same window (summed, pooled)."""
    measured = max(part["measured_s"] for part in parts)
    done = sum(part["requests"] for part in parts)
    ttft = [x for part in parts for x in part["ttft"]]
    itl = [x for part in parts for x in part["itl"]]
    tpot = [x for part in parts for x in part.get("tpot", [])]

    def pct(values: list[float], q: float) -> float | None:
        return round(1000 * sorted(values)[int(q * (len(values) - 1))], 2) if values else None

    return {"requests": done, "errors": sum(part["errors"] for part in parts), "measured_s": round(measured, 1),
            "requests_per_s": round(done / measured, 3), "tokens_per_s": round(sum(p["tokens"] for p in parts) / measured, 1),
            "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p90": pct(ttft, 0.9),
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p90": pct(itl, 0.9),
            "itl_ms_mean": round(1000 * statistics.fmean(itl), 2) if itl else None,
            # ITL is the gap between chunks, and a chunk carries every token queued for its stream (several under
            # load); TPOT is per token
            "tpot_ms_p50": pct(tpot, 0.5), "tpot_ms_p90": pct(tpot, 0.9), "client_processes": len(parts),
            # near 1: a client process was busy all the time, so the figures may be the load generator's limit
            "client_cpu_share_max": max(part.get("cpu_share", 0.0) for part in parts)}


def _load_in_process(args: tuple[str, str | list[str], int, float, float, int, int]) -> dict[str, Any]:
    """One client process's samples and the share of its wall time it spent on a CPU."""
    cpu, wall = time.process_time(), time.perf_counter()
    samples = asyncio.run(load_samples(*args))
    samples["cpu_share"] = round((time.process_time() - cpu) / (time.perf_counter() - wall), 2)
    return samples


def load_processes(url: str, prompt: str | list[str], concurrency: int, duration: float, warmup: float, max_tokens: int,
                   processes: int, pool_limit: int = 0) -> dict[str, Any]:
    """The same closed-loop load from ``processes`` client processes (the streams split evenly), so
    that one Python client — parsing every streamed chunk — is not what limits a fast server: on a
    2-core machine one client process and a minimal aiohttp server that emits a token to 256 streams
    every 3 ms took 57 k tokens/s of the 85 k offered, the client at 97 % of a core
    (``benchmarks/client_capacity.py``, ``results/client_capacity.md``)."""
    if processes <= 1:
        return summarise_load([_load_in_process((url, prompt, concurrency, duration, warmup, max_tokens, pool_limit))])
    import concurrent.futures
    import multiprocessing

    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        parts = list(pool.map(_load_in_process, [(url, prompt, n, duration, warmup, max_tokens, pool_limit) for n in shares if n]))
    return summarise_load(parts)


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    wanted = ("vexpert_bytes_streamed_total", "vexpert_balance_ratio", "vexpert_static_balance_ratio",
              "vexpert_plan_id", "vexpert_iterations_total", "vexpert_step_seconds_sum", "vexpert_step_seconds_count",
              "vexpert_slot_fill_wait_seconds_sum", "vexpert_slot_fill_wait_seconds_count",
              # the server's own view of a request: arrival at the API → first token / last token sent
              "vexpert_serve_time_to_first_token_seconds_sum", "vexpert_serve_time_to_first_token_seconds_count",
              "vexpert_serve_request_duration_seconds_sum", "vexpert_serve_request_duration_seconds_count")
    by_series = ("vexpert_worker_gc_seconds_total", "vexpert_serve_api_gc_seconds_total")  # one value per generation
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values: dict[str, list[float]] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            values.setdefault(name, []).append(float(line.rsplit(" ", 1)[1]))
        elif name in by_series:
            values.setdefault(line.rsplit(" ", 1)[0], []).append(float(line.rsplit(" ", 1)[1]))
    return {k: round(statistics.fmean(v), 4) for k, v in values.items()}


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, started: float, timeout_s: float) -> None:
    """Until ``url``/health answers 200; raise with the log's tail if the server exits or is not
    healthy ``timeout_s`` after ``started``."""
    import urllib.error
    import urllib.request

    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + log.read_text()[-3000:])
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"server not healthy in {timeout_s:.0f} s:\n" + log.read_text()[-3000:])
        time.sleep(0.5)


def serve_and_load(config: Path, model: Path, args: argparse.Namespace, log: Path) -> dict[str, Any]:

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vexpert_runtime", "serve", "--config", str(config), "--model", str(model),
           "--port", str(port), "--served-model-name", "bench", "--max-batch-tokens", str(args.max_batch_tokens),
           "--max-running", str(args.concurrency), "--drain-timeout", "10"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "runtime"),
                                                        os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, url, log, started, 600)
        ready_s = time.perf_counter() - started
        prompt = ("A mixture of experts model sends every token to a few of its many expert networks. " * 4)[:300]
        result = load_processes(url, prompt, args.concurrency, args.duration, args.warmup, args.max_tokens, 1)
        result["startup_s"] = round(ready_s, 1)
        result["metrics"] = scrape(url)
        return result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny shapes (H=256)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--profile", type=Path, default=None, help="calibrated PerformanceProfile JSON")
    parser.add_argument("--modes", nargs="+", default=["vexpert", "static"])
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    profile = json.loads(args.profile.read_text()) if args.profile else None
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                               "gpus": torch.cuda.device_count() if device == "cuda" else 0, "torch": torch.__version__,
                               "layers": args.layers, "experts": args.experts, "small": args.small,
                               "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory(prefix="vexpert-serve-load-") as tmp:
        started = time.perf_counter()
        tokenizer_dir = ensure_demo_model(Path(tmp) / "demo")
        model = write_model(Path(tmp) / "model", tokenizer_dir, args.layers, args.experts, args.small, device)
        results["model_write_s"] = round(time.perf_counter() - started, 1)
        for mode in args.modes:
            config = write_config(Path(tmp) / f"{mode}.yaml", model, device, 0.95 if mode == "vexpert" else 0.0,
                                  profile, args.k)
            results[mode] = serve_and_load(config, model, args, args.out / f"server_{mode}.log")
            print(mode, json.dumps(results[mode]), flush=True)
            (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
