"""``vexpert serve``: an OpenAI-compatible API on one port, served through the vExpert MoE path.

One node: the coordinator (L2 pool, slot fills), one worker per GPU (or ``--cpu-workers N``), each an
EP rank and a data-parallel attention rank running the Hugging Face model's non-expert layers for its
own requests; the allocator every k iterations on the served tokens' expert counts. The API process
tokenizes, sends each request to the least-loaded rank and streams the events back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from vexpert_runtime.commands import shared_help
from vexpert_runtime.config import (
    EXPERT_COMPUTE_HELP,
    KV_CACHE_DTYPE_HELP,
    LINEAR_FORMAT_HELP,
    ExpertComputeChoice,
    ExpertFormatChoice,
    KVCacheDtype,
    LinearFormatChoice,
)
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.model.expert_layout import CPU_EXPERT_KERNELS
from vexpert_runtime.serve.reasoning import ReasoningParser
from vexpert_runtime.serve.tool_calls import PARSERS as TOOL_CALL_PARSERS
from vexpert_runtime.serve.waiting_queue import SCHEDULING_POLICIES

REASONING_PARSER_NAMES: tuple[str, ...] = get_args(ReasoningParser)

if TYPE_CHECKING:  # imported where used: `vexpert --help` and the other commands stay free of torch
    from vexpert_runtime.config import RuntimeConfig
    from vexpert_runtime.node import NodeSetup
    from vexpert_runtime.serve.api import ApiConfig
    from vexpert_runtime.serve.multirank import MultiRankDispatcher
    from vexpert_runtime.serve.openai_api import SamplingDefaults
    from vexpert_runtime.serve.rank import ServeWorkerArgs
    from vexpert_runtime.serve.scheduler import SchedulerConfig

DEFAULT_PORT = 8000
DEMO_NAME = "vexpert-demo"


def _add_reply_options(parser: Any) -> None:
    """The flags that shape a chat reply: its tool calls, its reasoning, its template, its log-probabilities' tokens."""
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="read tool calls out of chat replies (requests with tools and tool_choice 'auto'), as "
                             "vLLM's parser of that name: 'hermes' for Qwen2.5 / Qwen3(-MoE) / Hermes models, "
                             "'deepseek_v3' for DeepSeek-V3 / R1, 'deepseek_v31' for DeepSeek-V3.1, 'kimi_k2' for "
                             "Kimi K2, 'qwen3_coder' for Qwen3-Coder (XML calls typed by the request's tools); "
                             "default: none (such requests must send tool_choice 'none'; 'required' and a "
                             "named function need no parser)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice 'auto' is served wherever "
                             "--tool-call-parser is given (without one it is refused, as vLLM refuses it without this "
                             "flag)")
    parser.add_argument("--chat-template", default=None,
                        help="the Jinja chat template to render chats with instead of the checkpoint's (vLLM's flag): "
                             "a file, or the template itself; e.g. vLLM's tool_chat_template_deepseekv3.jinja, which "
                             "DeepSeek-V3's tool calls need")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=None,
                        help="split chat replies into 'reasoning' (between <think> and </think>) and 'content', as "
                             "vLLM's parser of that name: 'deepseek_r1' for DeepSeek-R1, 'deepseek_v3' for "
                             "DeepSeek-V3.1 (thinking when chat_template_kwargs says so), 'qwen3' for Qwen3(-MoE), "
                             "'kimi_k2' for Kimi K2 Thinking; structured output then constrains the content only")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="log-probabilities name each token 'token_id:{id}' instead of its text, unless a request "
                             "says otherwise (vLLM's flag and request field: a token that is a byte of a longer "
                             "character is still told apart)")


def _add_model_options(parser: Any) -> None:
    """How the model's weights, activations and KV cache are kept (each over the config's field)."""
    parser.add_argument("--expert-format", choices=get_args(ExpertFormatChoice), default=None,
                        help="how routed experts are kept (the config's model.expert_format, default auto): auto = as "
                             "the checkpoint stores them (a block-FP8 checkpoint such as DeepSeek-V3's: FP8 rows, half "
                             "the memory and slot copies, read as FP8 by the GPU kernel; CPU ranks keep dense rows), "
                             "dense = in the model dtype (FP8 dequantised at load), fp8_block = FP8 rows (a dense "
                             "checkpoint's experts quantised at load, 128x128 blocks)")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="auto",
                        help="the compute dtype (the config's model.dtype; vLLM's names: half = float16, float = "
                             "float32); auto = the config's, else bfloat16 on GPUs and float32 on CPU ranks")
    parser.add_argument("--expert-compute", choices=get_args(ExpertComputeChoice), default=None,
                        help=shared_help(EXPERT_COMPUTE_HELP + " (the config's model.expert_compute, default auto)"))
    parser.add_argument("--linear-format", choices=get_args(LinearFormatChoice), default=None,
                        help=shared_help(LINEAR_FORMAT_HELP + " (the config's model.linear_format, default dense)"))
    parser.add_argument("--kv-cache-dtype", choices=get_args(KVCacheDtype), default=None,
                        help=shared_help(KV_CACHE_DTYPE_HELP + " (default: the config's runtime.kv_cache_dtype, else auto)"))


def _add_engine_options(parser: Any) -> None:
    """How a rank runs its steps and draws unseeded samples."""
    parser.add_argument("--overlap-steps", choices=("auto", "on", "off"), default="auto",
                        help="form iteration i+1 while the device runs iteration i (auto: with CUDA graphs; on CPU "
                             "the step is done when launched, so 'on' only exercises the protocol)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="fuse the step's small pieces (norms, routers, rotary, the EP layer's dispatch "
                             "bookkeeping, sampling) with torch.compile (auto: with CUDA graphs, where a step is "
                             "captured once and replayed; compiles take about a minute at start, cached on disk)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly on GPUs: no CUDA graphs and, under --compile auto, no "
                             "torch.compile (vLLM's): a start without the captures and compiles, for debugging or "
                             "a short-lived server, at the cost of the step's speed (CPU ranks always run eagerly)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the engine seed (vLLM's): a request without a seed of its own takes the next of a "
                             "stream this starts on each rank, so a restarted server sent the same requests in the "
                             "same order samples the same tokens; default: fresh entropy per request (vLLM's "
                             "default is 0). A request's own seed always wins")
    parser.add_argument("--cpu-expert-kernel", choices=CPU_EXPERT_KERNELS, default="auto",
                        help="how a CPU rank multiplies its resident experts (fp32): grouped (torch._grouped_mm "
                             "over the packed rows), prepacked (oneDNN, weights reordered at load), or auto: the "
                             "faster of the two on this machine, timed over the first layer's experts at load")


def _add_parallel_options(parser: Any) -> None:
    """vLLM's parallelism flags, as a vLLM command line brings them: vexpert's layout is vLLM's data parallelism with
    expert parallelism (each rank holds the non-expert model, runs attention for its own sequences and holds a share
    of the experts); tensor and pipeline parallelism are refused with what to pass instead."""
    parser.add_argument("--cpu-workers", type=int, default=None, help="N CPU worker processes (EP ranks) instead of GPUs")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                        help="EP ranks on this node: the first N visible GPUs, or N CPU workers (vLLM's data "
                             "parallelism with --enable-expert-parallel: each rank runs attention for its own "
                             "sequences and holds a share of the experts); default: every visible GPU, else "
                             "--cpu-workers")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="1 only: ranks shard the experts, not the layers (pass --data-parallel-size N for N ranks)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only: every rank holds every layer")
    parser.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                        help="accepted for vLLM's command lines: vexpert's ranks always shard the experts")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM's command lines: vexpert runs transformers' own model definitions "
                             "(DeepSeek-V3, Qwen3-MoE, Qwen2-MoE), never code from the checkpoint")


def _checked_parallel_ranks(args: argparse.Namespace, visible_gpus: int) -> int | None:
    """The ranks ``--data-parallel-size`` asks for (None: the default layout), after refusing the parallelism vexpert
    does not have; ``visible_gpus``: 0 where the ranks are CPU workers."""
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--pipeline-parallel-size", args.pipeline_parallel_size)):
        if value != 1:
            raise VExpertInputError(
                flag, f"{value}: vexpert does not split layers over GPUs — each rank holds the whole non-expert model "
                "and a share of the experts (vLLM's --data-parallel-size with --enable-expert-parallel)",
                f"drop {flag}; pass --data-parallel-size N for N ranks (default: every visible GPU)")
    dp = args.data_parallel_size
    if dp is None:
        return None
    if dp < 1:
        raise VExpertInputError("--data-parallel-size", f"{dp} is not ≥ 1", "the EP ranks on this node, e.g. 8")
    if visible_gpus and dp > visible_gpus:
        raise VExpertInputError("--data-parallel-size", f"{dp} ranks need {dp} GPUs, {visible_gpus} visible",
                                f"pass at most {visible_gpus}, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    if not visible_gpus and args.cpu_workers is not None and args.cpu_workers != dp:
        raise VExpertInputError("--data-parallel-size", f"{dp} ranks, but --cpu-workers asks for {args.cpu_workers}",
                                "pass one of the two (on CPU both name the worker processes)")
    return dp


def _add_checkpoint_options(parser: Any) -> None:
    """What is served, and under which names."""
    parser.add_argument("--config", default=None, help="runtime.yaml (RuntimeConfig; the node pod's config)")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the checkpoint, as in vLLM's `vllm serve MODEL` (the same as --model)")
    parser.add_argument("--model", default=None,
                        help="a local checkpoint directory (config.json, safetensors, tokenizer), or a Hugging Face "
                             "repo id (org/name) already in the local Hugging Face cache, served as that id (nothing "
                             "is downloaded)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model id clients send (default: the directory name); several: any of them is "
                             "served, the first named in answers (vLLM's)")
    parser.add_argument("--generation-config", choices=("auto", "vexpert"), default="auto",
                        help="defaults of the sampling fields a request leaves out: 'auto' takes temperature, "
                             "top_p, top_k, min_p, repetition_penalty and max_new_tokens from the checkpoint's "
                             "generation_config.json where it sets them (as vLLM does; logged at start), 'vexpert' the OpenAI API's "
                             "(temperature 1, no truncation)")


def _add_batch_options(parser: Any) -> None:
    """A rank's batch, queue, context and KV cache."""
    parser.add_argument("--max-batch-tokens", "--max-num-batched-tokens", type=int, default=None,
                        help="tokens per rank per iteration (prompt chunks + decodes; vLLM's --max-num-batched-tokens "
                             "names it too); default on GPUs "
                             f"max({GPU_BATCH_DEFAULTS[1]}, --max-running), on CPU max({CPU_BATCH_DEFAULTS[1]}, --max-running)")
    parser.add_argument("--max-running", "--max-num-seqs", type=int, default=None,
                        help=f"sequences per rank in one batch (vLLM's --max-num-seqs names it too; default "
                             f"{GPU_BATCH_DEFAULTS[0]} on GPUs, "
                             f"{CPU_BATCH_DEFAULTS[0]} on CPU)")
    parser.add_argument("--max-waiting", type=int, default=128, help="queued requests per rank before 429")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the longest sequence (prompt + output) served, at most the checkpoint's "
                             "max_position_embeddings (default: that); a chat's max_tokens defaults to what it "
                             "leaves (a completion's to 16, as vLLM's), and a rank's KV cache must hold one such "
                             "sequence (vLLM's --max-model-len)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV-cache tokens per rank (default: on GPUs what --gpu-memory-utilization leaves, "
                             "on CPU 8 full contexts of --max-model-len)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of each GPU's memory a rank may fill; the paged KV cache gets what the weights, "
                             "experts, slots and a 2 GiB headroom leave of it (default: the config's "
                             "runtime.gpu_memory_utilization, else 0.9)")
    parser.add_argument("--prefix-caching", "--enable-prefix-caching", action="store_true",
                        help="reuse the KV cache of prompt prefixes computed before (vLLM's --enable-prefix-caching; "
                             "whole 16-token blocks of the same "
                             "tokens from the prompt's start, e.g. a shared system prompt): their prefill is skipped")
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                        help="the order a rank admits waiting requests in and preempts running ones in (vLLM's): "
                             "fcfs, first come first served (default; a request's priority must be 0), or priority: "
                             "by the request's priority (lower first), then arrival")


def _add_server_options(parser: Any) -> None:
    """The HTTP server: where it listens, who may use it, how it streams and stops."""
    parser.add_argument("--host", default="0.0.0.0",
                        help="address to listen on; the default 0.0.0.0 exposes the API on every network interface "
                             "(reachable from other machines: set --api-key), 127.0.0.1 keeps it on this machine")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' (or Anthropic's 'x-api-key: <key>') on /v1/* (401 "
                             "otherwise; /health and /metrics stay open); default: the environment variable "
                             "VEXPERT_API_KEY, else no key")
    parser.add_argument("--header-timeout", type=float, default=15.0,
                        help="seconds a connection gets to send a request's headers (and to stay idle between "
                             "requests) before it is closed: a slow client cannot hold connections open")
    parser.add_argument("--api-servers", "--api-server-count", type=int, default=1,
                        help="API server processes sharing --port (SO_REUSEPORT; each tokenizes and streams its own "
                             "connections' requests): one interpreter per server, for hundreds of streams "
                             "(vLLM's --api-server-count)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="send a stream's tokens every N tokens (its first at once, its last with the finish): "
                             "fewer, larger SSE chunks cost the API process less at hundreds of streams; 1 sends "
                             "every token (default; benchmarks/README.md has the measured trade-off)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    parser.add_argument("--allowed-origins", default='["*"]',
                        help='browser origins that may call the API, a JSON list (vLLM\'s; default ["*"]: any), e.g. '
                             '\'["https://chat.example.com"]\'; a preflight is answered before the API key is asked for')
    parser.add_argument("--allowed-methods", default='["*"]', help='their methods, a JSON list (vLLM\'s)')
    parser.add_argument("--allowed-headers", default='["*"]',
                        help='their request headers, a JSON list (vLLM\'s)')
    parser.add_argument("--allow-credentials", action="store_true",
                        help="let them send credentials (cookies, Authorization) (vLLM's)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (vLLM's flag; by default, every 10 s while requests run: prompt "
                             "and generation throughput, running and waiting requests, KV-cache usage)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log one line per generation request as it is queued: its id, route, prompt lengths and "
                             "token ids, and sampling (vLLM's flag; off by default: prompts stay out of the log)")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="with --enable-log-requests, at most N prompt token ids per request (vLLM's; default: all)")
    parser.add_argument("--responses-store", type=int, default=0, metavar="N",
                        help="keep the last N Responses API responses of requests with store true in the API "
                             "process, for previous_response_id and GET /v1/responses/{id} (vLLM: "
                             "VLLM_ENABLE_RESPONSES_API_STORE); 0, the default: none (needs --api-servers 1)")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model's requests (OpenAI-compatible API) through vExpert",
        description=(
            "Serve /v1/completions, /v1/chat/completions, /v1/responses, Anthropic's /v1/messages (all with stream), "
            "/v1/models, /tokenize, /detokenize, /health and /metrics on one port; vLLM's names of the shared flags "
            "are accepted too. Without a MODEL (or --model) and without a config naming a checkpoint, serves the "
            "embedded demo model (a small DeepSeek-V3-shaped MoE with random weights and a local tokenizer) on CPU "
            "workers. Stops cleanly on SIGTERM: new requests get 503, running ones finish (or are aborted after "
            "--drain-timeout)."
        ),
    )
    _add_checkpoint_options(parser.add_argument_group("model"))
    _add_model_options(parser.add_argument_group("weights, activations and KV cache"))
    _add_parallel_options(parser.add_argument_group("parallelism (vLLM's names)"))
    _add_batch_options(parser.add_argument_group("batching and memory"))
    _add_engine_options(parser.add_argument_group("engine"))
    _add_server_options(parser.add_argument_group("API server"))
    _add_reply_options(parser.add_argument_group("replies"))
    parser.set_defaults(handler=run)


_AUTO_ON_OFF: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
# --dtype's values (vLLM's) → model.dtype
_DTYPES: dict[str, str | None] = {"auto": None, "bfloat16": "bfloat16", "float16": "float16", "half": "float16",
                                  "float32": "float32", "float": "float32"}


# (max_running, max_batch_tokens) per rank when not given. On one H200 (benchmarks/README.md §10, run 18)
# 256 streams with 256 / 512 served 29-31 k tokens/s, 64 running at most would cap a rank at 64 streams
# (25 k), and a budget of 2048 lost at 256 streams (22 k: an iteration of many prompt chunks stalls
# every decode of the batch, each prompt token ~4.4 us of GPU time on top of the decode step).
GPU_BATCH_DEFAULTS = (256, 512)
CPU_BATCH_DEFAULTS = (64, 256)  # a CPU rank's step grows with its batch: fewer, shorter iterations


def resolve_batch_limits(max_running: int | None, max_batch_tokens: int | None, device: str) -> tuple[int, int]:
    """``(max_running, max_batch_tokens)``: the flags where given, else the device's defaults
    (the token budget at least ``max_running``: every running sequence decodes a token each iteration)."""
    running_default, tokens_default = GPU_BATCH_DEFAULTS if device == "cuda" else CPU_BATCH_DEFAULTS
    running = running_default if max_running is None else max_running
    tokens = max(tokens_default, running) if max_batch_tokens is None else max_batch_tokens
    return running, tokens


def resolve_gpu_memory_utilization(cli: float | None, configured: float | None) -> float:
    """The share of each GPU's memory a rank may fill: ``--gpu-memory-utilization`` if given, else the
    config's ``runtime.gpu_memory_utilization`` (validated when the config was read), else 0.9."""
    from vexpert_runtime.config import DEFAULT_GPU_MEMORY_UTILIZATION

    if cli is None:
        return DEFAULT_GPU_MEMORY_UTILIZATION if configured is None else configured
    if not 0.0 < cli <= 1.0:  # also NaN
        raise VExpertInputError("--gpu-memory-utilization", f"{cli} is not in (0, 1]",
                                f"the share of each GPU's memory a rank may fill, e.g. {DEFAULT_GPU_MEMORY_UTILIZATION}")
    return cli


def _model_dir(args: argparse.Namespace, configured: str) -> tuple[Path, str | None]:
    """The checkpoint to serve and the model id it is served as by default (None: the embedded demo model)."""
    from vexpert_runtime.serve.demo_model import ensure_demo_model

    if args.model_tag and args.model and Path(args.model_tag).resolve() != Path(args.model).resolve():
        raise VExpertInputError("MODEL", f"two checkpoints named: {args.model_tag} and --model {args.model}",
                                "name the checkpoint once (vexpert serve PATH, or --model PATH)")
    named = args.model_tag or args.model
    if named or configured:
        field = ("MODEL" if args.model_tag else "--model") if named else "model.checkpoint_path"
        return checkpoint_dir(named or configured, field)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vexpert" / "demo-model"
    return ensure_demo_model(cache), None


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name (not ./name, ../name: local paths)


def checkpoint_dir(value: str, field: str) -> tuple[Path, str]:
    """The checkpoint directory ``value`` names and the model id it is served as by default: a local directory (its
    name), else a Hugging Face repo id (``org/name``) already in the local Hugging Face cache — where `vllm serve
    org/name` finds it — served as that id. Nothing is downloaded (a node pod has its checkpoint on a volume); a repo
    id not in the cache is an input error whose fix is the download command."""

    path = Path(value).expanduser()
    if (path / "config.json").is_file():
        return path, path.name
    if not path.exists() and _REPO_ID.fullmatch(value):
        from huggingface_hub import constants, snapshot_download

        try:
            cached = Path(snapshot_download(value, local_files_only=True))
        except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), not a valid id (HFValidationError)
            raise VExpertInputError(field, f"{value} is no local directory and not in the Hugging Face cache "
                                           f"({constants.HF_HUB_CACHE})",
                                    f"download it first (hf download {value}), or pass a local checkpoint "
                                    "directory") from None
        if (cached / "config.json").is_file():
            return cached, value
        path = cached
    raise VExpertInputError(field, f"{path} has no config.json", "pass a local checkpoint directory")


def _log_ready(ranks: int, started: float) -> None:
    _log(f"ready for requests: {ranks} ranks loaded {time.monotonic() - started:.1f} s after the node's start")


def _log(line: str) -> None:
    print(f"vexpert serve: {line}", file=sys.stderr, flush=True)


def _checked_api_key(args: argparse.Namespace) -> str | None:
    """Refuse impossible flags before anything is loaded; the API key from ``--api-key``, else the
    environment (None: no key)."""
    from vexpert_runtime.errors import CPU_WORKERS_MEANING, require_at_least

    require_at_least("--cpu-workers", args.cpu_workers, 1, CPU_WORKERS_MEANING)
    require_at_least("--stream-interval", args.stream_interval, 1, "tokens per streamed event (1: every token)")
    require_at_least("--api-servers", args.api_servers, 1, "API server processes sharing the port")
    require_at_least("--responses-store", args.responses_store, 0, "stored Responses API responses (0: none)")
    if args.responses_store > 0 and args.api_servers > 1:
        raise VExpertInputError("--responses-store", "each API server process would keep its own responses: a "
                                "follow-up reaching another process would not find its predecessor",
                                "pass --api-servers 1 with it, or leave it out")
    if args.api_servers > 1 and args.port == 0:
        raise VExpertInputError("--port", "0 (any free port) cannot be shared by several API servers",
                                "pass a port, or --api-servers 1")
    if not 0 <= args.port <= 65535:
        raise VExpertInputError("--port", f"{args.port} is not a TCP port", "pass 1–65535 (0: any free port)")
    if not args.header_timeout > 0:  # also NaN
        raise VExpertInputError("--header-timeout", f"{args.header_timeout} is not > 0", "seconds, e.g. 15")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise VExpertInputError("--max-log-len", f"{args.max_log_len} is not ≥ 0",
                                "the prompt token ids logged per request, e.g. 64 (leave it out: all)")
    if not args.drain_timeout >= 0:  # also NaN
        raise VExpertInputError("--drain-timeout", f"{args.drain_timeout} is not ≥ 0",
                                "seconds running requests get to finish on SIGTERM, e.g. 30 (0: abort them)")
    if args.served_model_name is not None and not all(name.strip() for name in args.served_model_name):
        raise VExpertInputError("--served-model-name", "a name is empty: clients could not send it as `model`",
                                "pass non-empty names, or leave the flag out (the checkpoint directory's name)")
    api_key: str | None = args.api_key if args.api_key is not None else os.environ.get("VEXPERT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise VExpertInputError("--api-key", "is empty", "pass a non-empty key, or neither --api-key nor VEXPERT_API_KEY")
    return api_key


def _runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    """``--config`` (the node pod's runtime.yaml), or one for this machine: every GPU an EP rank in
    bfloat16, else ``--cpu-workers`` (default 2) CPU ranks in float32."""
    import torch

    from vexpert_runtime.config import RuntimeConfig, load_runtime_config

    on_gpu = torch.cuda.is_available() and args.cpu_workers is None
    asked = _checked_parallel_ranks(args, torch.cuda.device_count() if on_gpu else 0)
    if args.config:
        config = load_runtime_config(args.config)  # (-dp is checked against its ranks: _resolve_served)
    else:
        ranks = asked or (torch.cuda.device_count() if on_gpu else (args.cpu_workers or 2))
        config = RuntimeConfig.model_validate({
            "model": {"dtype": "bfloat16" if on_gpu else "float32"},
            "parallelism": {"expert_parallel_size": ranks, "gpus_per_node": ranks},
            "runtime": {"device": "cuda" if on_gpu else "cpu", "metrics_port": 0},
        })
    for flag, field in ((args.expert_format, "expert_format"), (args.expert_compute, "expert_compute"),
                        (args.linear_format, "linear_format"), (_DTYPES[args.dtype], "dtype")):
        if flag is not None:  # the flag over the config's model.<field>
            config = config.model_copy(update={"model": config.model.model_copy(update={field: flag})})
    return config


@dataclass(frozen=True)
class _Served:
    """What this process serves and within which limits, all checked before a process starts."""

    model_dir: Path
    demo: bool  # the embedded demo model (no --model and no checkpoint in the config)
    name: str  # the model id clients send
    aliases: tuple[str, ...]  # other ids they may send for it (--served-model-name's after the first)
    model_config: dict[str, Any]
    max_context: int
    gpu_memory_utilization: float
    kv_cache_dtype: str  # --kv-cache-dtype, else the config's
    setup: NodeSetup
    scheduler: SchedulerConfig
    sampling_defaults: SamplingDefaults  # for the fields a request leaves out (--generation-config)
    notes: tuple[str, ...] = ()  # to log at start
    chat_template: str | None = None  # --chat-template's (checked: it renders a conversation), None: the model's
    cors: Any = None  # --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials (a CorsPolicy)


def _resolve_served(args: argparse.Namespace, config: RuntimeConfig) -> _Served:
    from vexpert_runtime.model.checkpoint import read_checkpoint_config
    from vexpert_runtime.node import resolve_setup
    from vexpert_runtime.serve.hf_model import checked_max_context
    from vexpert_runtime.serve.scheduler import SchedulerConfig

    model_dir, default_name = _model_dir(args, config.model.checkpoint_path)
    demo = default_name is None
    model_config = read_checkpoint_config(model_dir)  # context length and vocabulary for the API's checks
    max_context = checked_max_context(args.max_model_len, int(model_config.get("max_position_embeddings", 4096)))
    gpu_memory_utilization = resolve_gpu_memory_utilization(args.gpu_memory_utilization,
                                                            config.runtime.gpu_memory_utilization)
    setup = resolve_setup(config, str(model_dir), cpu_workers=args.cpu_workers)
    if args.data_parallel_size is not None and args.data_parallel_size != setup.local_workers:  # (--config's)
        raise VExpertInputError("--data-parallel-size", f"{args.data_parallel_size} ranks, but --config runs "
                                f"{setup.local_workers} on this node",
                                "drop --data-parallel-size: the config's parallelism (gpus_per_node) sets them")
    kv_tokens = args.kv_cache_tokens
    if kv_tokens is None and setup.device != "cuda":
        kv_tokens = 8 * max_context
    max_running, max_batch_tokens = resolve_batch_limits(args.max_running, args.max_batch_tokens, setup.device)
    scheduler = SchedulerConfig(kv_budget_tokens=kv_tokens, max_batch_tokens=max_batch_tokens,
                                max_running=max_running, max_waiting=args.max_waiting,
                                stream_interval=args.stream_interval, prefix_caching=args.prefix_caching,
                                scheduling_policy=args.scheduling_policy, seed=args.seed)
    scheduler.check(max_context)  # refuse impossible limits before any process starts
    defaults, notes = sampling_defaults(model_dir, args.generation_config)
    template = None if args.chat_template is None else load_chat_template(args.chat_template, model_dir)
    return _Served(
        model_dir=model_dir, demo=demo,
        name=args.served_model_name[0] if args.served_model_name else (default_name or DEMO_NAME),
        aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        model_config=model_config, max_context=max_context,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype or config.runtime.kv_cache_dtype,
        setup=setup, scheduler=scheduler, sampling_defaults=defaults, notes=tuple(notes), chat_template=template,
        cors=_cors_policy(args),
    )


def _start_message(served: _Served, args: argparse.Namespace, api_key: str | None) -> str:
    setup = served.setup
    what = "the embedded demo model" if served.demo else served.model_dir
    access = "an API key is required on /v1/*" if api_key else "no API key (anyone who reaches the port can use it)"
    servers = f" ({args.api_servers} API servers)" if args.api_servers > 1 else ""
    spec = setup.spec
    if spec.storage_block is not None:
        rows = f" as block-FP8 rows{' (quantised at load)' if spec.fp8_block is None else ''}"
        if spec.fp8_activations:
            rows += " × FP8 activations (w8a8)" if setup.device == "cuda" else " × FP8 activations (w8a8, emulated)"
    else:  # a block-FP8 checkpoint's experts in the compute dtype (--expert-format dense, or auto on CPU ranks)
        rows = "" if spec.fp8_block is None else " as dense rows (dequantised at load)"
    if setup.linear_format == "fp8_block":
        rows += ", other linear layers block-FP8" + (" × FP8 activations" if spec.fp8_activations else "")
    return (f"serving {what} as {served.name!r} on {args.host}:{args.port}{servers}: "
            f"{setup.local_workers} {setup.device} ranks in {setup.dtype}, {spec.num_layers} MoE layers × {spec.num_experts} "
            f"experts{rows}, G·Vmax = {setup.slots} slots per rank"
            f"{'' if served.kv_cache_dtype == 'auto' else f', KV cache in {served.kv_cache_dtype}'}"
            f"{', eager steps (--enforce-eager)' if args.enforce_eager and setup.device == 'cuda' else ''}"
            f"{'' if args.seed is None else f', engine seed {args.seed}'}; {access}")


def _api_config(served: _Served, args: argparse.Namespace, api_key: str | None) -> tuple[ApiConfig, Any]:
    """What every API server needs to know of the model, and this process's tokenizer."""
    from transformers import AutoTokenizer

    from vexpert_runtime.serve.api import ApiConfig

    tokenizer = AutoTokenizer.from_pretrained(str(served.model_dir), local_files_only=True)
    vocab = int(served.model_config.get("vocab_size", len(tokenizer)))
    return ApiConfig(served.name, served.max_context, vocab, args.drain_timeout, api_key=api_key, aliases=served.aliases,
                     header_timeout_s=args.header_timeout, sampling_defaults=served.sampling_defaults,
                     tool_call_parser=args.tool_call_parser, tokens_as_ids=args.return_tokens_as_token_ids,
                     reasoning_parser=args.reasoning_parser, chat_template=served.chat_template,
                     responses_store=args.responses_store, scheduling_policy=args.scheduling_policy,
                     log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                     log_stats_s=None if args.disable_log_stats else 10.0,
                     cors=served.cors), tokenizer


def _cors_policy(args: argparse.Namespace) -> Any:
    """``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers`` (JSON lists of strings, vLLM's) and
    ``--allow-credentials``."""
    from vexpert_runtime.serve.cors import CorsPolicy

    lists = {}
    for flag, value in (("--allowed-origins", args.allowed_origins), ("--allowed-methods", args.allowed_methods),
                        ("--allowed-headers", args.allowed_headers)):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
            raise VExpertInputError(flag, "is not a JSON list of strings",
                                    f'pass e.g. {flag} \'["*"]\' (any) or \'["https://app.example.com"]\'')
        lists[flag] = tuple(value)
    return CorsPolicy(lists["--allowed-origins"], lists["--allowed-methods"], lists["--allowed-headers"],
                      args.allow_credentials)


def load_chat_template(value: str, model_dir: Path) -> str:
    """``--chat-template``'s template: the file it names, else — where it holds a brace or a line break, as vLLM
    tells them — the template itself; checked by rendering a one-message conversation with the checkpoint's
    tokenizer (an input error naming the flag: a missing file, a template Jinja cannot render)."""
    from transformers import AutoTokenizer


    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif any(char in value for char in "{}\n"):
        template = value
    else:
        raise VExpertInputError("--chat-template", f"{value!r} is no file and no template",
                                "name a Jinja template file, or give the template itself")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
                                      chat_template=template)
    except Exception as exc:  # Jinja's syntax and undefined-variable errors, a template that raises
        raise VExpertInputError("--chat-template", f"the template does not render a conversation: {exc}",
                                "fix the template (a Jinja chat template over `messages`)") from None
    return template


def sampling_defaults(model_dir: Path, mode: str) -> tuple[SamplingDefaults, list[str]]:
    """The sampling defaults ``--generation-config mode`` gives (``auto``: the checkpoint's
    generation_config.json where it has one, as vLLM does; ``vexpert``: the OpenAI API's), and the
    lines to log about them. A generation config that is not a JSON object is an input error."""
    from vexpert_runtime.serve.openai_api import SamplingDefaults

    path = model_dir / "generation_config.json"
    if mode == "vexpert" or not path.is_file():
        return SamplingDefaults(), []
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VExpertInputError("--generation-config", f"{path} is not readable JSON ({exc})",
                                "fix the file, or pass --generation-config vexpert to ignore it") from None
    if not isinstance(config, dict):
        raise VExpertInputError("--generation-config", f"{path} is not a JSON object",
                                "fix the file, or pass --generation-config vexpert to ignore it")
    return SamplingDefaults.from_generation_config(config)


def rank_args(served: _Served, args: argparse.Namespace, requests: Any, events: Any) -> ServeWorkerArgs:
    """What one rank serves with (``requests``: its inbound queue; ``events``: the API servers' queues)."""
    from vexpert_runtime.serve.rank import ServeWorkerArgs

    setup = served.setup
    return ServeWorkerArgs(str(served.model_dir), served.scheduler, requests, events, served.gpu_memory_utilization,
                           ranks_per_gpu=setup.workers_per_gpu, overlap_steps=_AUTO_ON_OFF[args.overlap_steps],
                           compile=_AUTO_ON_OFF[args.compile], enforce_eager=args.enforce_eager,
                           cpu_expert_kernel=args.cpu_expert_kernel, max_context=served.max_context,
                           kv_cache_dtype=served.kv_cache_dtype, expert_format=setup.spec.expert_storage,
                           expert_compute="w8a8" if setup.spec.fp8_activations else "w8a16",
                           linear_format=setup.linear_format)


def run(args: argparse.Namespace) -> int:
    import torch

    from vexpert_runtime.node import NodeOptions
    from vexpert_runtime.node.runtime_process import NodeProcess
    from vexpert_runtime.ports import check_listen_address
    from vexpert_runtime.serve.api import ServeApi, configure_logging, run_server
    from vexpert_runtime.serve.api_servers import ApiServerArgs, ApiServers
    from vexpert_runtime.serve.hf_model import DEFAULT_BLOCK_SIZE
    from vexpert_runtime.serve.metrics_share import MetricsShare
    from vexpert_runtime.serve.multirank import MultiRankDispatcher
    from vexpert_runtime.workload import Workload

    configure_logging()
    api_key = _checked_api_key(args)
    served = _resolve_served(args, _runtime_config(args))
    # after every other input check (those name their own flags even where the default port is taken here),
    # before anything loads
    check_listen_address(args.host, args.port, reuse_port=args.api_servers > 1)
    for note in served.notes:
        _log(note)
    setup = served.setup
    servers = args.api_servers
    # spawn: CUDA cannot be initialised again in a forked child
    ctx = torch.multiprocessing.get_context("spawn")
    events = [ctx.Queue() for _ in range(servers)]  # one per API server: the ranks answer each its own
    requests = [ctx.Queue() for _ in range(setup.local_workers)]
    options = NodeOptions(
        workload=Workload(tokens_per_worker=served.scheduler.max_running),  # sizes the allocator's decode batch
        serve=[rank_args(served, args, inbound, events) for inbound in requests],
        log=_log,
    )
    dispatcher: MultiRankDispatcher | None = None
    others: ApiServers | None = None
    api_failure: list[str] = []

    def node_failed(message: str) -> None:  # on the node's reader thread: fail what runs, stop serving (exit 1)
        _log(f"node failed: {message}")
        if others is not None:
            others.expect_exit()  # they fail their own requests and exit (shared status)
        if dispatcher is not None:
            dispatcher.fail_all(f"the node failed: {message}")
        os.kill(os.getpid(), signal.SIGTERM)

    def api_server_died(line: str) -> None:  # the pod restarts: better than a port that drops connections
        _log(f"{line}: stopping every API server and the node")
        api_failure.append(line)
        os.kill(os.getpid(), signal.SIGTERM)

    # the supervisor and the allocator in a process of their own: the API process's one GIL is the
    # HTTP loop's, the tokenizer's and the ranks' events' (node/runtime_process.py says why)
    node = NodeProcess(ctx, setup, options, on_failure=node_failed,
                       on_ready=partial(_log_ready, setup.local_workers, time.monotonic()))
    node.start()  # its workers load the model while this process loads the tokenizer
    # one API server: the drain's end stops the node; several: the node stops once all have drained
    # with prefix caching on several ranks, a prompt goes where its prefix was computed (prefix_routing.py)
    prefix_block_size = DEFAULT_BLOCK_SIZE if args.prefix_caching and setup.local_workers > 1 else None
    dispatcher = MultiRankDispatcher(requests, events[0], args.max_waiting, node.readiness,
                                     node.request_stop if servers == 1 else lambda: None,
                                     prefix_block_size=prefix_block_size)
    metrics_dir = tempfile.mkdtemp(prefix="vexpert-api-metrics-") if servers > 1 else None
    try:
        api_config, tokenizer = _api_config(served, args, api_key)
        if servers > 1:
            assert metrics_dir is not None
            others = ApiServers(ctx, [ApiServerArgs(i, args.host, args.port, str(served.model_dir), api_config, requests,
                                                    events[i], args.max_waiting, node.status, metrics_dir, os.getpid(),
                                                    prefix_block_size)
                                      for i in range(1, servers)], on_death=api_server_died)
            others.start()
        api = ServeApi(dispatcher, tokenizer, api_config, node_metrics=node.metrics_text,
                       metrics_share=MetricsShare(metrics_dir, 0) if metrics_dir is not None else None)
        _log(_start_message(served, args, api_key))
        run_server(api, args.host, args.port, reuse_port=servers > 1,
                   on_stop=others.stop if others is not None else None)
    finally:
        if others is not None:
            others.join(args.drain_timeout + 15.0)
        node.stop()
        dispatcher.close()
        for q in (*requests, *events):
            q.cancel_join_thread()
            q.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    if node.failure is not None:
        print(f"error: node failed: {node.failure}", file=sys.stderr)
        return 1
    if api_failure:
        print(f"error: {api_failure[0]}", file=sys.stderr)
        return 1
    return 0
