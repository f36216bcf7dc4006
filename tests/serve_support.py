"""Test doubles of ``vexpert serve``: a tiny real MoE model + tokenizer, a full-recompute StepModel, a
server on a background event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from prometheus_client import CollectorRegistry

from vexpert_runtime.serve.api import ApiConfig, ApiServer, ServeApi
from vexpert_runtime.serve.cors import CorsPolicy
from vexpert_runtime.serve.dispatcher import EventChannel
from vexpert_runtime.serve.events import Event, GenerationRequest, RankLoad, shutting_down
from vexpert_runtime.serve.penalties import PenaltyInputs, penalized_logits
from vexpert_runtime.serve.sampling import (
    eos_token_ids,
    sample_tokens,
    sampling_tensors,
    token_logprobs,
    token_ranks,
)
from vexpert_runtime.serve.scheduler import Scheduler, SchedulerConfig
from vexpert_runtime.serve.step import (
    FinishedStep,
    PendingStep,
    PromptLogprobs,
    SequenceWork,
    StepLogprobs,
    StepModel,
    SynchronousSteps,
)
from vexpert_runtime.serve.structured_output import unpack_allowed
from vexpert_runtime.serve.waiting_queue import SchedulingPolicy

MODEL_NAME = "tiny-qwen3-moe"
MAX_CONTEXT = 96
CHAT_TEMPLATE = (  # Qwen3's shape: tools in a turn of their own, enable_thinking=false as an empty think block
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today? I am fine, thank you.",
    "once upon a time there was a tiny mixture of experts model",
    "experts are routed per token; the router picks the top two",
    "naïve café – déjà vu: ünïcödé text, 数字 and emoji 🙂",
]
T = TypeVar("T")
log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05  # an idle single-rank loop sleeps until a submit wakes it (or this long)
_DRAIN_POLL_S = 0.02
_ABORT_GRACE_S = 10.0  # how long shutdown waits for the step in progress


class IdText:
    """A tokenizer whose text is the token ids, ``<5><17>``: a test reads the tokens back from the events."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def id_text_tokens(text: str) -> list[int]:
    """The token ids of :class:`IdText`'s text."""
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def joined_tool_calls(deltas: Sequence[Any]) -> list[tuple[int, str | None, str, str]]:
    """A chat stream's ``tool_calls`` deltas (the OpenAI SDK's objects) joined per call, as a client joins them:
    (index, id, name, arguments) — the id and name from a call's first delta, its arguments concatenated."""
    calls: dict[int, list[Any]] = {}
    for delta in deltas:
        if delta.index not in calls:
            assert delta.function.name, "a call's first delta names it"
            calls[delta.index] = [delta.id, delta.function.name, ""]
        else:
            assert delta.id is None and delta.function.name is None, "only a call's first delta names it"
        calls[delta.index][2] += delta.function.arguments or ""
    return [(index, *calls[index]) for index in sorted(calls)]


def tiny_random_model(family: str) -> Any:
    """A tiny random transformers model (no checkpoint) of ``family``: DeepSeek-V3 (MLA, dense first layer,
    shared expert), Qwen3-MoE (GQA) or Qwen2-MoE (GQA with biases, sigmoid-gated shared expert); its
    one-dimensional parameters (biases, norms) drawn too, so that they matter."""
    import transformers

    common = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 32,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_experts_per_tok": 2,
              "max_position_embeddings": 64, "initializer_range": 0.1, "tie_word_embeddings": False}
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **common, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
            n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=8)
    else:
        config = transformers.Qwen2MoeConfig(**common, num_key_value_heads=2, num_experts=8,
                                             shared_expert_intermediate_size=48)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for param in model.parameters():  # biases are zero at init: make them matter
        if param.dim() == 1:
            param.data.normal_(0, 0.1)
    return model


def grammar_reference(model: Any, tokenizer: Any, prompt: Sequence[int], grammar: str, max_tokens: int,
                      bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding under an llguidance grammar, written out: transformers' logits over the whole sequence (plus a
    logit ``bias``), llguidance's own mask applied by llguidance (``apply_token_bitmask_inplace``), the argmax; EOS
    ends it (not included)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    from vexpert_runtime.serve.sampling import eos_token_ids

    eos = sorted(eos_token_ids(tokenizer))
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, max(model.config.vocab_size, len(tokenizer)), eos)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    mask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[:, -1].float()
        for token, value in (bias or {}).items():
            logits[0, token] += value
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, mask)
        token = int(logits.argmax())
        if token in eos:
            break
        assert matcher.consume_token(token)
        ids.append(token)
        out.append(token)
    return out


def serve_with_scheduler(directory: Path, tokenizer: Any, requests: list[GenerationRequest], overlapped: bool,
           seen: list[list[SequenceWork]] | None = None) -> dict[str, list[Event]]:
    """The requests through the product's scheduler and a batched float32 model of the checkpoint at ``directory``
    (steps overlapped or not); ``seen``: every step's work."""
    from vexpert_runtime.serve.hf_model import HFStepModel
    from vexpert_runtime.serve.sampling import eos_token_ids as eos_ids

    model = HFStepModel(directory, dtype=torch.float32, kv_cache_tokens=1024, block_size=4)
    model.overlaps_steps = overlapped
    if seen is not None:
        launch = model.launch

        def recording(work: Sequence[SequenceWork]) -> Any:
            seen.append(list(work))
            return launch(work)

        model.launch = recording  # type: ignore[method-assign]
    scheduler = Scheduler(model, tokenizer, SchedulerConfig(None, max_batch_tokens=64, max_running=8),
                          eos_ids(tokenizer))
    events: dict[str, list[Event]] = {r.request_id: [] for r in requests}
    for request in requests:
        scheduler.submit(request, events[request.request_id].append)
    for _ in range(3000):
        if not scheduler.has_work():
            break
        scheduler.run_iteration()
    assert not scheduler.has_work() and scheduler.pool.used_blocks == 0
    return events


def build_tiny_checkpoint(directory: Path, family: str = "qwen3_moe", special_tokens: Sequence[str] = (),
                          max_position_embeddings: int = 256, added_tokens: Sequence[str] = ()) -> None:
    """A byte-level BPE tokenizer (chat template, EOS; ``special_tokens`` more special tokens, ``added_tokens``
    more tokens that are not special — as Qwen3's ``<think>``) and a random
    float32 Qwen3-MoE (or DeepSeek-V3: ``family="deepseek_v3"``, MLA, a dense first layer, grouped routing),
    saved to ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        PreTrainedTokenizerFast,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    if added_tokens:
        fast.add_tokens(list(added_tokens))
    fast.save_pretrained(directory)

    torch.manual_seed(1234)
    if family == "deepseek_v3":
        ds_config = DeepseekV3Config(
            vocab_size=len(fast), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=max_position_embeddings,
            eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None,
            tie_word_embeddings=False, initializer_range=0.2,
        )
        model = DeepseekV3ForCausalLM(ds_config).eval()
        for layer in model.model.layers[1:]:  # a non-zero correction bias: the router's noaux_tc path matters
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
        model.save_pretrained(directory)
        return
    config = Qwen3MoeConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # type: ignore[call-arg]  # a Qwen3 config kwarg its stub does not list
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked logits: greedy has clear winners, so recompute == KV-cached generate
    )
    Qwen3MoeForCausalLM(config).eval().save_pretrained(directory)


def block_fp8_copies(src: Path, root: Path, block: tuple[int, int] = (16, 16)) -> tuple[Path, Path]:
    """(a block-FP8 copy of checkpoint ``src`` in DeepSeek-V3's format — every projection F8_E4M3 with F32
    ``weight_scale_inv``, config.json's ``quantization_config`` —, an fp32 copy whose projections are
    those FP8 weights dequantised: what the FP8 checkpoint means, for transformers to run)."""
    from safetensors.torch import load_file, save_file

    from vexpert_runtime.model.expert_format import dequantize_fp8_block, quantize_fp8_block

    tensors = load_file(str(src / "model.safetensors"))
    fp8, dequantised = dict(tensors), dict(tensors)
    for name, weight in tensors.items():
        if name.endswith("_proj.weight"):
            fp8[name], fp8[name + "_scale_inv"] = quantize_fp8_block(weight, block)
            dequantised[name] = dequantize_fp8_block(fp8[name], fp8[name + "_scale_inv"], block, torch.float32)
    config = json.loads((src / "config.json").read_text())
    paths = (root / "fp8", root / "dequantised")
    for path in paths:  # the tokenizer and generation config, where the checkpoint has them
        shutil.copytree(src, path, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    for path, weights, extra in ((paths[0], fp8, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic"}}),
                                 (paths[1], dequantised, {})):
        (path / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return paths


def load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def load_model(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).eval()


def _penalized(logits: torch.Tensor, held: list[int], prompt_len: int, spec: Any) -> torch.Tensor:
    """``logits`` [1, V] with the logit bias and penalties of ``spec`` over a sequence's tokens ``held``
    (prompt first)."""
    vocab = logits.shape[1]
    bias = torch.zeros(1, vocab)
    for token, value in spec.logit_bias:
        bias[0, token] = value
    mask = spec.allowed if spec.allowed is not None else spec.only  # a grammar's next tokens, allowed_token_ids
    if mask is not None:
        bias = bias.masked_fill(~unpack_allowed(mask[: (vocab + 31) // 32].unsqueeze(0), vocab), float("-inf"))
    seen = torch.zeros(1, vocab, dtype=torch.bool)
    seen[0, held] = True
    counts = torch.bincount(torch.tensor(held[prompt_len:], dtype=torch.int64), minlength=vocab).to(torch.int32)
    one = torch.ones(1)
    inputs = PenaltyInputs(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool), torch.zeros(1, dtype=torch.int64),
                           one * spec.repetition, one * spec.presence, one * spec.frequency)
    return penalized_logits(logits, seen, counts.unsqueeze(0), inputs, bias)


class RecomputeStepModel(SynchronousSteps):
    """A :class:`~vexpert_runtime.serve.step.StepModel` that recomputes each sequence from scratch.

    Slow but obviously right: it only has to honour the contract, which it checks (``position`` must
    equal what it holds, ``release`` must come for every sequence, a ``fed`` token is one the previous
    step sampled). ``delay_s`` slows each step; ``gate`` (when set) makes steps wait for it, to hold
    requests in flight. ``overlaps_steps``: let the scheduler overlap steps (``fed`` decodes).
    """

    kv_block_size = 16
    kv_cache_bytes = 0

    def __init__(self, hf_model: Any, max_context: int = MAX_CONTEXT, kv_num_blocks: int = 1024,
                 overlaps_steps: bool = False) -> None:
        self.overlaps_steps = overlaps_steps
        self.last_sampled: list[int] = []  # the previous step's sampled ids, in sampling-row order
        self.hf_model = hf_model
        self.vocab_size = int(hf_model.config.vocab_size)
        self.max_context = max_context
        self.kv_num_blocks = kv_num_blocks
        self.held: dict[int, list[int]] = {}
        self.steps: list[list[SequenceWork]] = []
        self.released: list[int] = []
        self.delay_s = 0.0
        self.gate: threading.Event | None = None

    def kv_bytes_per_token(self) -> int:
        cfg = self.hf_model.config
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4

    def launch(self, work: Sequence[SequenceWork]) -> PendingStep:
        """The step, with the sampled tokens' log-probabilities where a row asks (as the product's model)."""
        tokens = self.step(work)
        prompt = PromptLogprobs(self._prompt, self._prompt_ranks) if self._prompt else None
        if not self._logprobs:
            return FinishedStep(tokens, None, prompt)
        rows, outputs = zip(*self._logprobs, strict=True)
        return FinishedStep(tokens, StepLogprobs.at_rows(len(work), rows, *(torch.cat(t) for t in zip(*outputs,
                                                                                                        strict=True))),
                            prompt)

    def step(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        self._logprobs: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        self._prompt: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._prompt_ranks: dict[int, torch.Tensor] = {}
        self.steps.append(list(work))
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay_s:
            time.sleep(self.delay_s)
        out = torch.full((len(work),), -1, dtype=torch.int64)
        for row, item in enumerate(work):
            held = self.held.setdefault(item.seq_id, [])
            assert item.position == len(held), f"seq {item.seq_id}: position {item.position} != {len(held)} held"
            assert len(item.blocks) * self.kv_block_size >= item.position + len(item.tokens)
            if item.fed is not None:
                assert self.overlaps_steps and len(item.tokens) == 1, "fed only to an overlapping model, one token"
                held.append(self.last_sampled[item.fed])
            else:
                held.extend(item.tokens)
            wanted = [(item.position + i, t) for i, t in enumerate(item.prompt_targets) if t >= 0]
            if wanted:  # the prompt's log-probabilities at these positions
                with torch.no_grad():
                    every = self.hf_model(torch.tensor([held])).logits[0].float()
                positions, targets = zip(*wanted, strict=True)
                self._prompt[row] = token_logprobs(every[list(positions)], torch.tensor(targets), min(20, self.vocab_size))
                self._prompt_ranks[row] = token_ranks(every[list(positions)], torch.tensor(targets))
            if item.sample is not None:
                with torch.no_grad():
                    logits = self.hf_model(torch.tensor([held])).logits[0, -1:].float()
                sampled_from = logits
                if item.penalty_prompt_len >= 0:  # vLLM's penalties over what this sequence holds
                    sampled_from = _penalized(logits, held, item.penalty_prompt_len, item.sample)
                out[row] = sample_tokens(sampled_from, *sampling_tensors([item.sample], "cpu"))[0]
                if item.sample.logprobs:
                    self._logprobs.append((row, token_logprobs(logits, out[row : row + 1], min(20, self.vocab_size))))
        self.last_sampled = [int(t) for t, item in zip(out, work, strict=True) if item.sample is not None]
        return out

    def release(self, seq_id: int) -> None:
        self.held.pop(seq_id, None)
        self.released.append(seq_id)


# A one-rank dispatcher for the API tests: the scheduler on a thread of the test process (the
# product's dispatcher is vexpert_runtime.serve.multirank, over a node's worker processes).


class InProcessDispatcher:
    """One scheduler on a background thread of this process.

    ``lockstep_idle``: step the model even with no work (what a rank of a multi-rank server must
    do); a lone rank can sleep instead.
    """

    def __init__(self, scheduler: Scheduler, lockstep_idle: bool = False) -> None:
        self.scheduler = scheduler
        self.lockstep_idle = lockstep_idle
        self.step_failures = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vexpert-serve-rank0", daemon=True)
        self._started = False

    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def _loop(self) -> None:
        """Iterate while there is work; a failed step is logged and the loop goes on."""
        while not self._stop.is_set():
            self._wake.clear()
            if not (self.lockstep_idle or self.scheduler.has_work()):
                self._wake.wait(_IDLE_WAIT_S)
                continue
            try:
                self.scheduler.run_iteration()
            except Exception:
                self.step_failures += 1
                log.exception("model step failed; its requests got an error, the rank goes on")

    async def submit(self, request: GenerationRequest) -> AsyncIterator[list[Event]]:
        if self._stop.is_set():
            raise shutting_down()
        channel = EventChannel(asyncio.get_running_loop())
        self.scheduler.submit(request, channel.put)
        self._wake.set()
        return channel.__aiter__()

    def cancel(self, request_id: str) -> None:
        self.scheduler.cancel(request_id)
        self._wake.set()

    def ready(self) -> str | None:
        if not self._thread.is_alive():
            return "the rank loop is not running"
        if self._stop.is_set():
            return "shutting down"
        return None

    def loads(self) -> list[RankLoad]:
        return [self.scheduler.load()]

    async def shutdown(self, drain_timeout_s: float) -> None:
        self.scheduler.stop_accepting()
        deadline = time.monotonic() + drain_timeout_s
        while self.scheduler.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if self.scheduler.has_work():
            log.warning("drain timeout (%.1f s): aborting the requests still running", drain_timeout_s)
            self.scheduler.abort_all("server shut down before the request finished")
            self._wake.set()
            # the abort lands at the start of the next iteration, after the step in progress
            deadline = time.monotonic() + _ABORT_GRACE_S
            while self.scheduler.has_work() and self._thread.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(_DRAIN_POLL_S)
        self._stop.set()
        self._wake.set()
        if self._started:
            await asyncio.to_thread(self._thread.join, _ABORT_GRACE_S)


def single_rank_api(
    model: StepModel,
    api_tokenizer: Any,
    rank_tokenizer: Any,
    model_name: str,
    scheduler_config: SchedulerConfig,
    eos_ids: frozenset[int],
    drain_timeout_s: float = 30.0,
    registry: CollectorRegistry | None = None,
) -> ServeApi:
    """A one-rank server: a :class:`Scheduler` on an :class:`InProcessDispatcher` (started) behind a
    :class:`ServeApi`. ``api_tokenizer`` and ``rank_tokenizer`` must be two instances (two threads)."""
    scheduler = Scheduler(model, rank_tokenizer, scheduler_config, eos_ids)
    dispatcher = InProcessDispatcher(scheduler)
    dispatcher.start()
    config = ApiConfig(model_name, model.max_context, model.vocab_size, drain_timeout_s,
                       scheduling_policy=scheduler_config.scheduling_policy)
    return ServeApi(dispatcher, api_tokenizer, config, registry)


class BackgroundServer:
    """An :class:`ApiServer` on 127.0.0.1 (free port) with its event loop on a daemon thread."""

    def __init__(self, api: ServeApi, dispatcher: InProcessDispatcher, model: RecomputeStepModel) -> None:
        self.api = api
        self.dispatcher = dispatcher
        self.model = model
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = ApiServer(api, "127.0.0.1", 0)
        self.url = ""

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> BackgroundServer:
        self.thread.start()
        port = self.run(self.server.start())
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop_async(self) -> Any:
        """Begin the graceful stop; returns a concurrent future."""
        return asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop)

    def close(self) -> None:
        if not self.api.shutting_down:
            self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class ScriptedStepModel(RecomputeStepModel):
    """Samples ``script`` token by token, then ``end`` (EOS), whatever the logits: the reply a test needs the
    model to give (a tool call, say). The cache bookkeeping and checks are :class:`RecomputeStepModel`'s."""

    def __init__(self, hf_model: Any, script: Sequence[int], end: int) -> None:
        super().__init__(hf_model, max_context=256)  # it never runs the model: room for a chat template with tools
        self.script, self.end = list(script), end

    def step(self, work: Sequence[SequenceWork]) -> torch.Tensor:
        self._logprobs, self._prompt, self._prompt_ranks = [], {}, {}
        self.steps.append(list(work))
        out = torch.full((len(work),), -1, dtype=torch.int64)
        for row, item in enumerate(work):
            self.held.setdefault(item.seq_id, []).extend(item.tokens)
            if item.sample is not None:
                draw = item.sample.draw
                out[row] = self.script[draw] if draw < len(self.script) else self.end
        return out


def make_server(
    checkpoint: Path,
    hf_model: Any,
    *,
    model: StepModel | None = None,
    kv_budget_tokens: int = 4 * MAX_CONTEXT,
    max_batch_tokens: int = 64,
    max_running: int = 32,
    max_waiting: int = 64,
    drain_timeout_s: float = 10.0,
    scheduling_policy: SchedulingPolicy = "fcfs",
    cors: CorsPolicy | None = None,
) -> BackgroundServer:
    """A started single-rank server over the tiny model (the API and the rank each get a tokenizer);
    ``model``: another step model than the tiny model recomputed; ``cors``: its CORS policy (else the default)."""
    model = model or RecomputeStepModel(hf_model)
    rank_tokenizer = load_tokenizer(checkpoint)
    config = SchedulerConfig(kv_budget_tokens, max_batch_tokens, max_running, max_waiting,
                             scheduling_policy=scheduling_policy)
    api = single_rank_api(
        model, load_tokenizer(checkpoint), rank_tokenizer, MODEL_NAME, config, eos_token_ids(rank_tokenizer),
        drain_timeout_s, CollectorRegistry(),
    )
    assert isinstance(api.dispatcher, InProcessDispatcher)
    dispatcher = api.dispatcher
    if cors is not None:  # (read when the server starts and builds its app)
        api.config = dataclasses.replace(api.config, cors=cors)
    return BackgroundServer(api, dispatcher, model).start()
