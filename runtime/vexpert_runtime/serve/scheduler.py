"""Continuous batching for one rank: which sequences run each iteration, and with which tokens.

A :class:`Scheduler` owns one rank's :class:`~.step.StepModel`. Requests join and leave between
iterations. Every :meth:`Scheduler.run_iteration`:

1. takes in what other threads sent since the last one (new requests, cancellations, an abort);
2. builds the batch under a per-iteration token budget (``max_batch_tokens``): first one token for
   every decoding sequence (so running decodes never stall behind a long prompt), then prompt
   chunks in admission order — a prompt longer than what is left is split over iterations
   (chunked prefill); waiting requests are admitted while the KV cache has room for their prompt;
3. launches the model's step (``model.launch``) — always, with an empty batch when idle, because on
   a multi-rank server every rank steps in lockstep (the MoE layers are collectives);
4. reads each sampled token, detokenizes incrementally, checks EOS, stop strings and length, and
   sends :class:`~.events.Event`\\ s to the request's sink.

Where the model ``overlaps_steps`` (CUDA graphs), step 4 of iteration i runs after step 3 of
iteration i+1, while the device computes: iteration i+1 decodes with the tokens i sampled on the
device (``SequenceWork.fed``), a sequence at its length limit is not scheduled again, and one that
stops on EOS or a stop string (or is cancelled) while a step holds it keeps its blocks until that step
is done (:mod:`.step`).

KV cache: the scheduler owns the rank's :class:`~.kv_cache.BlockPool` (the model owns the tensors).
Blocks are taken as a sequence grows, not for its worst case (``max_tokens`` defaults to the whole
context, and most requests stop long before), and all return when it finishes. A waiting request is
admitted (in the policy's order, :mod:`.waiting_queue`: the head waits and blocks the rest) when the free blocks, less what the prompts
already admitted still need and a 1 % watermark, hold its prompt and first token; so a prefill never
stalls. When the decodes of an iteration need more blocks than are free, the scheduler first reads
the step in flight (its finished sequences free theirs), then **preempts** the running sequence
that comes last in the policy's order (``fcfs``: the newest; ``priority``: the least urgent, the newest among
equals — vLLM's; a re-admitted one keeps its place, so the same sequence is not recomputed over and over): its
blocks go back (published first with prefix caching, so it may attach them again), it returns to the queue where it
stood (under ``fcfs`` its head) and, re-admitted, prefills its prompt and the tokens
it had produced, then goes on sampling from where it was (same seeds per position: the same tokens);
its client sees only a pause. A request that does not fit yet **waits**; a 429 comes only when the
queue itself is full. The pool must hold at least one full-context sequence (checked at
construction), so a sequence running alone is never preempted and every valid request finishes.
With ``prefix_caching`` an admitted prompt attaches the cached blocks of its longest
already-computed prefix (whole blocks, never its last token: that one's logits are needed) and starts
its prefill after them; its own full prompt blocks are published as the steps that compute them launch,
and its output's full blocks when it finishes (a chat's next turn continues from them).

Only ``submit``, ``cancel``, ``abort_all``, ``stop_accepting``, ``load`` and ``has_work`` may be
called from other threads; ``run_iteration`` runs on the rank's loop thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.serve.events import (
    MAX_LOGPROBS,
    Event,
    EventLogprobs,
    GenerationRequest,
    RankLoad,
    SamplingParams,
    TokenLogprobs,
    UsageDetails,
    overloaded,
    shutting_down,
    with_token_ids,
)
from vexpert_runtime.serve.kv_cache import BlockPool, blocks_for, salt_digest, token_block_digests
from vexpert_runtime.serve.sampling import IncrementalDetokenizer, StopChecker, engine_seeds, request_seed
from vexpert_runtime.serve.step import (
    PendingStep,
    PromptLogprobs,
    SamplingSpec,
    SequenceWork,
    StepLogprobs,
    StepModel,
)
from vexpert_runtime.serve.structured_output import GrammarMatcher, GrammarTokens, pack_allowed
from vexpert_runtime.serve.waiting_queue import SchedulingPolicy, WaitingQueue, check_policy, order_key

log = logging.getLogger(__name__)

EventSink = Callable[[Event], None]  # called on the scheduler's thread; must not block


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one rank.

    ``kv_budget_tokens``: KV-cache tokens the rank may hold (all sequences; the model's cache may
    hold fewer, and then bounds it); ``max_batch_tokens``:
    tokens run per iteration (prompt chunks + decodes); ``max_running``: sequences in the batch;
    ``max_waiting``: queued requests beyond which ``submit`` refuses with 429; ``prefix_caching``:
    reuse the KV blocks of prompt prefixes computed before (module docstring); ``stream_interval``:
    a request's tokens go out as one event every this many (its first at once, its last with the
    finish): fewer, larger events and SSE chunks for the API process at hundreds of streams, for
    chunkier streams (SGLang's ``--stream-interval``; 1 sends every token); ``scheduling_policy``: the order
    requests are admitted and preempted in (:mod:`.waiting_queue`: ``fcfs`` or ``priority``, vLLM's); ``seed``: the
    engine seed (vLLM's ``--seed``) — a request that brings no seed takes the next of a stream it starts on each rank
    (:func:`~vexpert_runtime.serve.sampling.engine_seeds`), so a restarted server sent the same requests in the same
    order samples the same tokens.
    """

    kv_budget_tokens: int | None  # None: every block of the model's cache
    max_batch_tokens: int = 512
    max_running: int = 64
    max_waiting: int = 256
    stream_interval: int = 1
    prefix_caching: bool = False
    scheduling_policy: SchedulingPolicy = "fcfs"
    seed: int | None = None  # requests without a seed draw theirs from this one's stream (--seed); None: fresh entropy

    def check(self, max_context: int, capacity_tokens: int | None = None) -> None:
        """Raise :class:`VExpertInputError` for limits that could never serve a valid request
        (``capacity_tokens``: what the model's KV cache holds, block-rounded)."""
        budgets = [b for b in (self.kv_budget_tokens, capacity_tokens) if b is not None]
        budget = min(budgets) if budgets else max_context
        if budget < max_context:
            raise VExpertInputError(
                "kv_budget_tokens",
                f"{budget} KV tokens cannot hold one full-context sequence ({max_context} tokens)",
                "give the KV cache more memory (--kv-cache-tokens / --gpu-memory-utilization) or a shorter "
                "context (--max-model-len)",
            )
        if self.max_running < 1:
            raise VExpertInputError("max_running", f"{self.max_running} is not ≥ 1",
                                    "the sequences a rank decodes at once (--max-running), e.g. 64")
        if self.max_waiting < 0:
            raise VExpertInputError("max_waiting", f"{self.max_waiting} is not ≥ 0",
                                    "the requests a rank queues before answering 429 (--max-waiting), e.g. 128")
        if self.stream_interval < 1:
            raise VExpertInputError("stream_interval", f"{self.stream_interval} is not ≥ 1",
                                    "tokens per streamed event: 1 sends every token, e.g. 4 sends every fourth")
        check_policy(self.scheduling_policy)
        if self.max_batch_tokens < self.max_running:
            # every running sequence decodes one token per iteration; the budget must fit them all
            raise VExpertInputError(
                "max_batch_tokens", f"{self.max_batch_tokens} < max_running {self.max_running}",
                "raise it (--max-batch-tokens) to max_running or more: each running sequence decodes a token an iteration"
            )


def scheduler_pool(model: StepModel, config: SchedulerConfig) -> BlockPool:
    """The block pool the scheduler accounts with: the model's blocks, capped by the configured budget."""
    size = model.kv_block_size
    if config.kv_budget_tokens is None:
        return BlockPool(model.kv_num_blocks, size)
    cap = blocks_for(config.kv_budget_tokens, size) + 1  # + the scratch block
    return BlockPool(min(model.kv_num_blocks, cap), size)


@dataclass(eq=False, slots=True)  # identity: the waiting queue's remove finds this very sequence
class _Sequence:
    """A request's state inside the scheduler (read for every sequence of every iteration: plain
    slotted fields, no properties on the hot path)."""

    seq_id: int
    request: GenerationRequest
    sink: EventSink
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    seed: int
    prompt_len: int = field(init=False)  # len(request.prompt_ids), kept: read every iteration
    max_tokens: int = field(init=False)  # request.params.max_tokens, likewise
    penalty_prompt_len: int = field(init=False)  # SequenceWork's: prompt_len with penalties or a logit bias, else −1
    bias: tuple[tuple[int, float], ...] = field(init=False)  # the logit bias: the request's, its 1-token bad words −inf
    bad_words: tuple[tuple[int, ...], ...] = field(init=False)  # its bad words of several tokens, checked at each draw
    early_bias: tuple[tuple[int, float], ...] = ()  # the logit bias before min_tokens: the stop ids at −inf
    grammar: GrammarMatcher | None = None  # structured output: where the output is in its grammar
    reasoning: bool = False  # before its end-of-reasoning token (SamplingParams.reasoning_end): a grammar waits
    reasoning_tokens: int = 0  # output tokens before that token
    stop_reason: int | None = None  # the stop_token_ids token that ended it (a stop string's: stop.matched)
    cached_tokens: int | None = None  # prompt tokens its first admission took from the prefix cache
    only: torch.Tensor | None = None  # allowed_token_ids as a bitmask (SamplingSpec.only); None: every token
    reasoning_stop: torch.Tensor | None = None  # a thinking budget's: only reasoning_end, as a bitmask
    constrained: bool = False  # each draw reads the output before it (a grammar, bad words, a thinking budget near:
    # constraint_change): no overlapped steps
    prefill_len: int = field(init=False)  # tokens to compute before decoding: the prompt (+ output after a preemption)
    computed: int = 0  # tokens the model holds in its KV cache (or will, once the launched steps are done)
    admitted: bool = False
    output: list[int] = field(default_factory=list)
    pending: int = 0  # tokens launched steps sample that the host has not read yet (at most 2, briefly)
    sample_row: int = -1  # the last launched one's sampling row in its step
    steps_in_flight: int = 0  # launched steps that hold this sequence (its blocks stay until they are done)
    holds_blocks: bool = False  # has a block table in the pool (from admission until released or preempted)
    finished: bool = False
    table: tuple[int, ...] = ()  # its block table as last sent (one tuple per growth, not per iteration)
    digests: list[bytes] = field(default_factory=list)  # its full prefill blocks' (prefix caching)
    published: int = 0  # of them, published so far
    returns_ids: bool = field(init=False)  # the request asks for its token ids (return_token_ids): read per event
    ids_sent: int = 0  # output ids the events carried so far (a request asking for them)
    unsent_text: str = ""  # produced, held for the next event (stream_interval > 1)
    unsent_tokens: int = 0
    # log-probabilities, when the request asks (None until then: no list per sequence in the steady state):
    unsent_logprobs: list[TokenLogprobs] | None = None  # the unsent tokens' (and a finishing token's)
    prompt_logprobs: list[TokenLogprobs] | None = None  # the prompt's, until the first event with a token
    prompt_reported: int = 1  # prompt tokens [1, this) have their log-probability (a recomputed prefill skips them)
    # time.monotonic() at submission, first admission and first token read (None: not yet): its UsageDetails' durations
    queued_at: float = field(init=False)
    scheduled_at: float | None = None
    first_token_at: float | None = None

    def __post_init__(self) -> None:
        self.queued_at = time.monotonic()
        self.prompt_len = self.prefill_len = len(self.request.prompt_ids)
        self.max_tokens = self.request.params.max_tokens
        self.penalty_prompt_len = self.prompt_len if self.request.params.holds_row else -1
        self.bias, self.bad_words = split_bad_words(self.request.params.logit_bias, self.request.params.bad_words)
        self.returns_ids = self.request.params.return_token_ids

    def known_tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens ``start .. end-1`` of prompt + output (read ones)."""
        prompt = self.request.prompt_ids
        if end <= self.prompt_len:
            return tuple(prompt[start:end])
        return (*prompt[start:], *self.output[max(0, start - self.prompt_len): end - self.prompt_len])

    @property
    def generated(self) -> int:
        """Tokens sampled so far, read or not."""
        return len(self.output) + self.pending

    def sampling(self) -> SamplingSpec:
        params = self.request.params
        draw = self.generated
        return SamplingSpec(params.temperature, params.top_p, self.seed, draw, params.top_k, params.min_p,
                            params.logprobs is not None, params.repetition_penalty, params.presence_penalty,
                            params.frequency_penalty, self.early_bias if draw < params.min_tokens else self.bias,
                            only=self.only)

    def prompt_targets(self, start: int, end: int) -> tuple[int, ...]:
        """A prefill chunk's :attr:`~.step.SequenceWork.prompt_targets` (positions ``start .. end-1``): the
        prompt token after each position, where its log-probability is still to report; () when the
        request asks for none."""
        if self.request.params.prompt_logprobs is None:
            return ()
        prompt, first = self.request.prompt_ids, self.prompt_reported
        return tuple(prompt[p + 1] if first <= p + 1 < self.prompt_len else -1 for p in range(start, end))

    def take_logprobs(self) -> EventLogprobs | None:
        """The log-probabilities of the tokens an event about to be sent accounts for (and the prompt's,
        with the first); None when there are none."""
        if not self.unsent_logprobs and not self.prompt_logprobs:
            return None
        taken = EventLogprobs(tuple(self.unsent_logprobs or ()), tuple(self.prompt_logprobs or ()))
        self.unsent_logprobs = self.prompt_logprobs = None
        return taken

    def last_pending(self, max_context: int) -> bool:
        """Whether the token still being sampled is this sequence's last (length or context limit)."""
        if not self.pending:
            return False
        generated = len(self.output) + self.pending
        return generated >= self.max_tokens or self.prompt_len + generated >= max_context

    def decode_work(self, pool: BlockPool) -> SequenceWork:
        computed = self.computed
        if computed >= len(self.table) * pool.block_size:  # the new token starts a block
            self.table = tuple(pool.grow(self.seq_id, computed + 1))
        params = self.request.params  # sampling(), inlined: this runs per sequence per iteration
        draw = len(self.output) + self.pending
        spec = SamplingSpec(params.temperature, params.top_p, self.seed, draw, params.top_k,
                            params.min_p, params.logprobs is not None, params.repetition_penalty,
                            params.presence_penalty, params.frequency_penalty,
                            self.early_bias if draw < params.min_tokens else self.bias, only=self.only)
        if self.pending:  # its token is on the device, sampled by the step still running
            return SequenceWork(self.seq_id, (0,), computed, self.table, spec, self.sample_row, self.penalty_prompt_len)
        return SequenceWork(self.seq_id, (self.output[-1],), computed, self.table, spec, None, self.penalty_prompt_len)

    def prefill_work(self, budget: int, pool: BlockPool) -> SequenceWork:
        """The next prefill chunk, at most ``budget`` tokens (sampling if it ends the prefill)."""
        end = min(self.prefill_len, self.computed + budget)
        self.table = tuple(pool.grow(self.seq_id, end))
        return SequenceWork(self.seq_id, self.known_tokens(self.computed, end), self.computed,
                            self.table, self.sampling() if end == self.prefill_len else None, None,
                            self.penalty_prompt_len, self.prompt_targets(self.computed, end))


def check_request(request: GenerationRequest, max_context: int, vocab_size: int) -> None:
    """Reject what the API should have caught already, so one bad request never reaches a batch."""
    n = len(request.prompt_ids)
    params = request.params
    if n == 0:
        raise VExpertInputError("prompt", "is empty")
    if params.max_tokens < 1:
        raise VExpertInputError("max_tokens", "must be ≥ 1")
    for name, count in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if count is not None and not 0 <= count <= MAX_LOGPROBS:
            raise VExpertInputError(name, f"must be in [0, {MAX_LOGPROBS}]")
    if n + params.max_tokens > max_context:
        raise VExpertInputError("max_tokens", f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the context "
                                f"({max_context})")
    if not params.repetition_penalty > 0 or not -2 <= params.presence_penalty <= 2 or not -2 <= params.frequency_penalty <= 2:
        raise VExpertInputError("repetition_penalty", "must be > 0 (presence_penalty and frequency_penalty in [-2, 2])")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise VExpertInputError("min_tokens", f"must be in [0, max_tokens = {params.max_tokens}]")
    if any(not 0 <= token < vocab_size or not -100 <= bias <= 100 for token, bias in params.logit_bias):
        raise VExpertInputError("logit_bias", f"token ids must be in [0, {vocab_size}) and biases in [-100, 100]")
    if any(not word or min(word) < 0 or max(word) >= vocab_size for word in params.bad_words):
        raise VExpertInputError("bad_words", f"each word's token ids must be in [0, {vocab_size}) (and at least one)")
    if params.allowed_token_ids and not 0 <= min(params.allowed_token_ids) <= max(params.allowed_token_ids) < vocab_size:
        raise VExpertInputError("allowed_token_ids", f"token ids must be in [0, {vocab_size})")
    if params.seed is not None and not -(2**63) <= params.seed < 2**64:
        raise VExpertInputError("seed", "must fit in 64 bits")
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
        raise VExpertInputError("prompt", f"token ids must be in [0, {vocab_size})")


def early_bias(params: SamplingParams, eos_ids: frozenset[int], bias: tuple[tuple[int, float], ...]
               ) -> tuple[tuple[int, float], ...]:
    """A sequence's logit bias until ``min_tokens`` tokens are out: its own (``bias``), with −inf on the ids that
    would end it (its stop token ids, and EOS unless it ignores EOS), as vLLM's min-tokens processor masks them; ()
    without ``min_tokens``."""
    if params.min_tokens <= 0:
        return ()
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    return banning(bias, stops)


def banning(bias: tuple[tuple[int, float], ...], tokens: Iterable[int]) -> tuple[tuple[int, float], ...]:
    """Logit bias ``bias`` (sorted (id, bias) pairs) with −inf on ``tokens``, sorted."""
    return tuple(sorted({**dict(bias), **dict.fromkeys(tokens, float("-inf"))}.items()))


def split_bad_words(bias: tuple[tuple[int, float], ...], bad_words: tuple[tuple[int, ...], ...]
                    ) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, ...], ...]]:
    """(``bias`` with −inf on the one-token bad words — never drawn —, the bad words of several tokens — their
    last token is banned where the output ends with the rest: :func:`banned_next`)."""
    single = [word[0] for word in bad_words if len(word) == 1]
    return (banning(bias, single) if single else bias), tuple(word for word in bad_words if len(word) > 1)


def banned_next(output: Sequence[int], bad_words: tuple[tuple[int, ...], ...]) -> list[int]:
    """The tokens the next draw may not take: the last of each bad word (of several tokens) whose other tokens the
    output ends with — vLLM's ``apply_bad_words`` (only the output counts, not the prompt)."""
    return [word[-1] for word in bad_words
            if len(word) - 1 <= len(output) and tuple(output[len(output) - len(word) + 1:]) == word[:-1]]


def only_among(allowed: torch.Tensor, ids: Iterable[int]) -> bool:
    """Whether bitmask ``allowed`` [W] int32 allows no token but (some of) ``ids``."""
    words = allowed.numpy().view(np.uint32).copy()
    for token in ids:
        if token // 32 < len(words):
            words[token // 32] &= ~np.uint32(1 << (token % 32))
    return not words.any()


def _token_logprobs(step: StepLogprobs, row: int, token: int, k: int) -> TokenLogprobs:
    """Work item ``row``'s sampled ``token`` with its log-probability and the ``k`` most likely tokens'."""
    top = zip(step.top_ids[row, :k].tolist(), step.top_logprobs[row, :k].tolist(), strict=True)
    return TokenLogprobs(token, float(step.sampled[row]), tuple(top))


def _keep_prompt_logprobs(seq: _Sequence, item: SequenceWork, prompt: PromptLogprobs | None, row: int) -> bool:
    """Keep work item ``row``'s prompt log-probabilities (its targets ≥ 0, in order) on ``seq``; False when
    the step did not compute them."""
    wanted = [target for target in item.prompt_targets if target >= 0]
    if not wanted:
        return True
    if prompt is None or row not in prompt.items:
        return False
    target_lp, top_ids, top_lp = prompt.items[row]
    ranks = prompt.ranks.get(row)
    k = seq.request.params.prompt_logprobs or 0
    for i, target in enumerate(wanted):
        seq.prompt_logprobs = seq.prompt_logprobs or []
        seq.prompt_logprobs.append(TokenLogprobs(target, float(target_lp[i]), tuple(
            zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist(), strict=True)), None if ranks is None else int(ranks[i])))
    last = max(p for p, target in enumerate(item.prompt_targets) if target >= 0)
    seq.prompt_reported = item.position + last + 2  # the target of position p is token p + 1
    return True


def constrain_draws(batch: list[tuple[_Sequence, SequenceWork]], grammars: GrammarTokens) -> None:
    """Each constrained draw of the batch takes only what its grammar allows next (the host has read every
    token before it: :func:`split_running`), all masks in one call, none of the tokens that would complete one of
    its bad words, and only the end of its reasoning once its thinking budget is spent. A grammar that allows nothing but the ids ``min_tokens`` holds back (it is complete) ends the
    output all the same."""
    constrained = [(seq, seq.grammar, item.sample) for seq, item in batch
                   if seq.grammar is not None and item.sample is not None and not seq.reasoning]
    if constrained:
        masks = grammars.allowed([grammar for _, grammar, _ in constrained if grammar is not None])
        for (seq, _, spec), allowed in zip(constrained, masks, strict=True):
            assert spec is not None
            if seq.only is not None:  # and only its allowed token ids
                allowed = allowed.clone()
                allowed[: len(seq.only)] &= seq.only
                allowed[len(seq.only):] = 0
            spec.allowed = allowed
            if seq.early_bias and spec.logit_bias is seq.early_bias and only_among(
                    allowed, (token for token, bias in seq.early_bias if bias < 0)):
                spec.logit_bias = seq.bias
    for seq, item in batch:
        if item.sample is None:
            continue
        if seq.reasoning and seq.reasoning_stop is not None and thinking_spent(seq):
            item.sample.allowed = seq.reasoning_stop  # the budget is spent: the reasoning ends now (vLLM's)
        if seq.bad_words:
            banned = banned_next(seq.output, seq.bad_words)
            if banned:
                item.sample.logit_bias = banning(item.sample.logit_bias, banned)


def thinking_spent(seq: _Sequence, ahead: int = 0) -> bool:
    """Whether ``seq``'s reasoning has taken its thinking budget (``ahead``: counting that many more tokens)."""
    budget = seq.request.params.thinking_budget
    return budget is not None and seq.reasoning_tokens + ahead >= budget


def constraint_change(seq: _Sequence) -> int:
    """Mark whether each of ``seq``'s draws must read the output before it — a grammar, bad words, or a reasoning one
    token from its thinking budget (the draw after the budget is forced: it must know the reasoning has not ended) —;
    the change in the count of such sequences (+1, −1, 0)."""
    now = seq.grammar is not None or bool(seq.bad_words) or (seq.reasoning and thinking_spent(seq, ahead=1))
    if now == seq.constrained:
        return 0
    seq.constrained = now
    return 1 if now else -1


def split_running(running: Iterable[_Sequence], block_size: int, max_context: int, constrained: bool = False
                  ) -> tuple[list[_Sequence], list[_Sequence], int, int]:
    """The running sequences that decode this iteration and those still prefilling; the blocks
    the decodes take now and those the prefills will take until their first token. ``constrained``: some
    sequence reads its output before each draw (a grammar, bad words; False: none is looked for)."""
    decoding: list[_Sequence] = []
    prefilling: list[_Sequence] = []
    need = committed = 0
    for seq in running:
        if seq.computed < seq.prefill_len:
            prefilling.append(seq)
            committed += blocks_for(seq.prefill_len + 1, block_size) - len(seq.table)
        elif not seq.last_pending(max_context) and not (constrained and seq.pending and seq.constrained):
            # (a constrained sequence's next draw depends on the token still being sampled: it sits out a step)
            decoding.append(seq)
            if seq.computed >= len(seq.table) * block_size:  # its token starts a block
                need += 1
    return decoding, prefilling, need, committed


def new_sequence(seq_id: int, request: GenerationRequest, sink: EventSink, tokenizer: object, eos_ids: frozenset[int],
                 vocab_size: int, seed: int) -> _Sequence:
    """A request's sequence, its stop strings, detokenizer, logit biases and allowed tokens made; ``seed``: what it
    samples with (:func:`~vexpert_runtime.serve.sampling.request_seed`)."""
    params = request.params
    seq = _Sequence(seq_id=seq_id, request=request, sink=sink, stop=StopChecker(params.stop, params.include_stop_str),
                    detokenizer=IncrementalDetokenizer(tokenizer, request.prompt_ids, params.skip_special_tokens),
                    seed=seed)
    seq.early_bias = early_bias(params, eos_ids, seq.bias)
    seq.reasoning = params.reasoning_end is not None
    if params.reasoning_end is not None and params.thinking_budget is not None:
        seq.reasoning_stop = pack_allowed((params.reasoning_end,), vocab_size)
    if params.allowed_token_ids:
        seq.only = pack_allowed(params.allowed_token_ids, vocab_size)
        if seq.early_bias and only_among(seq.only, (token for token, bias in seq.early_bias if bias < 0)):
            seq.early_bias = seq.bias  # min_tokens would leave no token to draw: it yields (as to a grammar)
    return seq


def flush_text(seq: _Sequence) -> str:
    """Text held back (partial character, possible stop-string prefix) when a sequence ends."""
    text, stopped = seq.stop.push(seq.detokenizer.flush())
    return text if stopped else text + seq.stop.flush()


def usage_details(seq: _Sequence, prefix_caching: bool) -> UsageDetails:
    """A finishing sequence's usage details: the prompt tokens the prefix cache served and its reasoning tokens
    (where known), and its time here — queued, to its first token, to now."""
    reasoning = seq.request.params.reasoning_end is not None
    now = time.monotonic()
    scheduled = now if seq.scheduled_at is None else seq.scheduled_at
    first = seq.first_token_at
    return UsageDetails(seq.cached_tokens or 0 if prefix_caching or reasoning else None,
                        seq.reasoning_tokens if reasoning else None, scheduled - seq.queued_at,
                        None if first is None else first - scheduled, None if first is None else now - first,
                        seq.stop.matched if seq.stop.matched is not None else seq.stop_reason)


def publish_known(pool: BlockPool, seq: _Sequence) -> None:
    """Publish a finishing or preempted sequence's full blocks of prompt and output: a later prompt
    that continues it (a chat's next turn, or itself re-admitted) attaches them. Only tokens whose
    KV a launched step writes and whose ids are read (an overlapped step may still hold the last one)."""
    size = pool.block_size
    known = min(seq.computed, seq.prompt_len + len(seq.output))
    if known // size > seq.published:  # the digests go on from the prefill's whole blocks (seq.digests)
        start = len(seq.digests) * size
        more = token_block_digests(seq.known_tokens(start, known), size, seq.digests[-1] if seq.digests else b"")
        pool.publish(seq.seq_id, seq.digests + more)


def _order(seq: _Sequence, policy: str) -> tuple[int, int]:
    return order_key(policy, seq.request.priority, seq.seq_id)  # numbered as requests arrive


@dataclass(frozen=True)
class _LaunchedStep:
    """A step the model is running: its batch and its tokens to come."""

    batch: list[tuple[_Sequence, SequenceWork]]
    step: PendingStep


class Scheduler:
    """Continuous batching over one :class:`StepModel` (see the module docstring)."""

    def __init__(
        self, model: StepModel, tokenizer: object, config: SchedulerConfig, eos_ids: frozenset[int] = frozenset(),
        rank: int = 0,
    ) -> None:
        self.pool = scheduler_pool(model, config)
        config.check(model.max_context, self.pool.capacity_tokens())
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos_ids = eos_ids
        self._grammars = GrammarTokens(tokenizer, model.vocab_size, eos_ids)  # llguidance's view of the tokenizer
        self._constrained = 0  # live sequences with a grammar or bad words (none: no such work per iteration)
        self._stream_interval = config.stream_interval  # read per token
        self._engine_seeds = engine_seeds(config.seed, rank)  # None: unseeded requests take fresh entropy
        self._lock = threading.Lock()
        self._inbox: list[tuple[GenerationRequest, EventSink]] = []
        self._cancels: set[str] = set()
        self._abort: str | None = None
        self._accepting = True
        self._waiting: WaitingQueue[_Sequence] = WaitingQueue()
        self._running: dict[int, _Sequence] = {}  # insertion order = admission order
        self._by_request: dict[str, _Sequence] = {}
        self._next_seq_id = 0
        self._in_flight: _LaunchedStep | None = None  # the step whose tokens are not read yet (overlapped)
        self._kv_tokens_used = 0  # sum of computed over _running, kept as it changes (read twice an iteration)
        self._watermark = self.pool.usable_blocks // 100  # free blocks admission leaves for the decodes' growth
        self._preemptions = 0
        self._load = RankLoad(kv_tokens_budget=self.pool.capacity_tokens(), kv_blocks_total=self.pool.usable_blocks,
                              kv_cache_bytes=model.kv_cache_bytes)

    # ---- called from any thread -------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue a request; its events go to ``sink``. Raises :class:`~.events.ServeRefusal`
        (queue full or shutting down) or :class:`VExpertInputError` (a request no rank can run)."""
        check_request(request, self.model.max_context, self.model.vocab_size)
        with self._lock:
            if not self._accepting:
                raise shutting_down()
            if len(self._waiting) + len(self._inbox) >= self.config.max_waiting:
                raise overloaded(self.config.max_waiting)
            self._inbox.append((request, sink))

    def cancel(self, request_id: str) -> None:
        """Drop a request (client gone) before the next iteration; unknown ids are ignored."""
        with self._lock:
            self._cancels.add(request_id)

    def abort_all(self, message: str) -> None:
        """Finish every request with ``finish_reason="abort"`` before the next iteration."""
        with self._lock:
            self._abort = message

    def stop_accepting(self) -> None:
        """Refuse new requests (503) from now on; queued and running ones continue."""
        with self._lock:
            self._accepting = False

    def has_work(self) -> bool:
        """Whether an iteration would do anything beyond the lockstep empty step."""
        with self._lock:
            pending = bool(self._inbox or self._cancels or self._abort)
        return pending or bool(self._running or self._waiting or self._in_flight)

    def load(self) -> RankLoad:
        """The load as of the last iteration, plus requests submitted since."""
        with self._lock:
            queued = len(self._inbox)
        snapshot = self._load
        return dataclasses.replace(snapshot, waiting=snapshot.waiting + queued) if queued else snapshot

    # ---- the rank's loop thread -------------------------------------------------------------

    def run_iteration(self) -> int:
        """One iteration (see the module docstring); returns the tokens the model ran.

        If the model fails, every sequence of the failed step (and of the step still in flight)
        finishes with an error event and is released, then the exception propagates: the loop owner
        decides whether the rank goes on.
        """
        self._take_inbox()
        batch = self._schedule()
        if not batch and self._in_flight is not None:  # nothing runs before its tokens are read
            self._complete(self._take_in_flight())
            batch = self._schedule()
        self._update_load()  # admissions show while the step runs (a step can take a while)
        if self._constrained:
            constrain_draws(batch, self._grammars)
        work = [w for _, w in batch]
        try:
            step = self.model.launch(work)
        except Exception as exc:
            self._fail(batch, exc)
            raise
        self._launched(batch)
        previous, self._in_flight = self._in_flight, _LaunchedStep(batch, step)
        if previous is not None:
            self._complete(previous)  # while the device runs the step just launched
        if not self.model.overlaps_steps or not batch:  # an empty step samples nothing to wait for
            self._complete(self._take_in_flight())
        self._update_load()
        return sum(len(w.tokens) for w in work)

    def _take_in_flight(self) -> _LaunchedStep:
        flight, self._in_flight = self._in_flight, None
        assert flight is not None
        return flight

    def _launched(self, batch: list[tuple[_Sequence, SequenceWork]]) -> None:
        """The batch is on its way: its sequences hold what it writes, and wait for what it samples."""
        row = tokens = 0
        for seq, item in batch:
            n = len(item.tokens)
            seq.computed += n
            tokens += n
            seq.steps_in_flight += 1
            if item.sample is not None:
                seq.pending += 1
                seq.sample_row = row
                row += 1
            if seq.published < len(seq.digests):  # prefix caching: full prompt blocks this step writes
                full = min(seq.computed // self.pool.block_size, len(seq.digests))
                if full > seq.published:
                    self.pool.publish(seq.seq_id, seq.digests[:full])
                    seq.published = full
        self._kv_tokens_used += tokens  # every sequence of a batch is running

    def _complete(self, flight: _LaunchedStep) -> None:
        """Read a launched step's tokens and advance its sequences."""
        try:
            tokens = flight.step.result().tolist()
            logprobs = flight.step.logprobs()
            prompt = flight.step.prompt_logprobs()
        except Exception as exc:
            self._fail(flight.batch, exc)
            raise
        for row, (token, (seq, item)) in enumerate(zip(tokens, flight.batch, strict=True)):
            seq.steps_in_flight -= 1
            if seq.finished:  # stopped or cancelled while this step ran: its row was wasted
                self._release_if_idle(seq)
                continue
            if item.prompt_targets and not _keep_prompt_logprobs(seq, item, prompt, row):
                self._finish(seq, "error", error="this model does not report prompt log-probabilities")
                continue
            if item.sample is not None:  # the chunk completed the prompt, or a decode: a new token
                seq.pending -= 1
                if not item.sample.logprobs:
                    self._advance(seq, token)
                elif logprobs is None:
                    self._finish(seq, "error", error="this model does not report log-probabilities")
                else:
                    self._advance(seq, token, _token_logprobs(logprobs, row, token, seq.request.params.logprobs or 0))

    def _fail(self, batch: list[tuple[_Sequence, SequenceWork]], exc: Exception) -> None:
        """A step failed: its sequences and those of the step still in flight end with an error (and
        no cached prefix is trusted any more: the step may have left blocks half written)."""
        self.pool.forget_published()
        flight, self._in_flight = self._in_flight, None
        for seq, _ in batch + (flight.batch if flight is not None else []):
            seq.steps_in_flight = 0
            if not seq.finished:
                self._finish(seq, "error", error=f"model step failed: {exc}")
            else:
                self._release_if_idle(seq)
        self._update_load()

    def _take_inbox(self) -> None:
        """Apply what other threads sent: new requests, cancellations, a global abort."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            abort, self._abort = self._abort, None
        for request, sink in inbox:
            seq = self._new_sequence(request, sink)
            self._waiting.push(_order(seq, self.config.scheduling_policy), seq)
            self._by_request[request.request_id] = seq
            if request.params.grammar is not None:
                self._start_grammar(seq, request.params.grammar)
            if not seq.finished:
                self._constrained += constraint_change(seq)
        for request_id in cancels:
            cancelled = self._by_request.get(request_id)
            if cancelled is not None:
                self._finish(cancelled, "abort", error="cancelled")
        if abort is not None:
            for aborted in list(self._by_request.values()):
                self._finish(aborted, "abort", error=abort)

    def _new_sequence(self, request: GenerationRequest, sink: EventSink) -> _Sequence:
        self._next_seq_id += 1
        return new_sequence(self._next_seq_id - 1, request, sink, self.tokenizer, self.eos_ids, self.model.vocab_size,
                            request_seed(request.params.seed, self._engine_seeds))

    def _split(self) -> tuple[list[_Sequence], list[_Sequence], int, int]:
        return split_running(self._running.values(), self.pool.block_size, self.model.max_context, self._constrained > 0)

    def _start_grammar(self, seq: _Sequence, grammar: str) -> None:
        try:
            seq.grammar = self._grammars.matcher(grammar)
        except Exception as exc:  # the API compiled it: a tokenizer llguidance cannot read, or a bug
            log.exception("grammar of %s", seq.request.request_id)
            self._finish(seq, "error", error=f"structured output failed: {exc}")

    def _schedule(self) -> list[tuple[_Sequence, SequenceWork]]:
        """This iteration's batch: decodes first, then prompt chunks, then admissions."""
        pool, size = self.pool, self.pool.block_size
        decoding, prefilling, need, committed = self._split()
        while need + committed > pool.free_blocks:  # the decodes outgrow the cache
            if self._in_flight is not None:  # its finished sequences free blocks (and victims must be idle)
                self._complete(self._take_in_flight())
            else:  # the last in the policy's order: fcfs the newest, the least served (waiting_queue.py)
                self._preempt(max(self._running.values(), key=partial(_order, policy=self.config.scheduling_policy)))
            decoding, prefilling, need, committed = self._split()
        spare = pool.free_blocks - need - committed  # what admissions may take (chunks take from committed)
        batch = [(seq, seq.decode_work(pool)) for seq in decoding]
        budget = self.config.max_batch_tokens - len(batch)
        for seq in prefilling:
            if budget <= 0:
                break
            item = seq.prefill_work(budget, pool)
            batch.append((seq, item))
            budget -= len(item.tokens)
        while budget > 0 and self._waiting and len(self._running) < self.config.max_running:
            head = self._waiting.peek()
            wanted = blocks_for(head.prefill_len + 1, size)  # its prefill and its first token
            if wanted + (self._watermark if self._running else 0) > spare:
                break  # in order: the head waits for room, and the rest behind it
            self._waiting.pop()
            self._admit(head)
            spare -= wanted
            item = head.prefill_work(budget, pool)
            batch.append((head, item))
            budget -= len(item.tokens)
        return batch

    def _admit(self, seq: _Sequence) -> None:
        seq.admitted = seq.holds_blocks = True
        if seq.scheduled_at is None:  # (a preempted sequence's first admission counts)
            seq.scheduled_at = time.monotonic()
        self.pool.add(seq.seq_id)
        self._running[seq.seq_id] = seq
        if self.config.prefix_caching:
            size = self.pool.block_size
            seq.digests = token_block_digests(seq.known_tokens(0, seq.prefill_len), size,
                                              salt_digest(seq.request.params.cache_salt))
            # whole blocks, and never the prefill's last token: its logits give the next token; none for a
            # penalized sequence (the model learns its tokens from the ones it computes: penalties.py) nor for
            # one that asks for its prompt's log-probabilities (they come from computing it)
            params = seq.request.params
            reusable = 0 if params.penalized or params.prompt_logprobs is not None else (seq.prefill_len - 1) // size
            attached = self.pool.attach_prefix(seq.seq_id, seq.digests[:reusable])
            seq.computed = attached * size
            if seq.cached_tokens is None:  # (a preempted sequence re-attaches its own blocks: not the prompt's)
                seq.cached_tokens = seq.computed
            seq.published = attached
            self._kv_tokens_used += seq.computed

    def _preempt(self, seq: _Sequence) -> None:
        """Give a running sequence's blocks back and queue it where it stood: re-admitted, it prefills its
        prompt and output so far and goes on (no launched step may hold it)."""
        assert seq.steps_in_flight == 0 and not seq.pending
        del self._running[seq.seq_id]
        self._kv_tokens_used -= seq.computed
        if self.config.prefix_caching:
            publish_known(self.pool, seq)  # re-admitted while they stay cached, it attaches them
        self.pool.free(seq.seq_id)
        self._release_model(seq)
        seq.admitted = seq.holds_blocks = False
        seq.computed = seq.published = 0
        seq.table, seq.digests = (), []
        seq.prefill_len = seq.prompt_len + len(seq.output)
        self._waiting.push(_order(seq, self.config.scheduling_policy), seq)
        self._preemptions += 1
        log.debug("preempted %s after %d tokens (KV cache full)", seq.request.request_id, len(seq.output))

    def _advance(self, seq: _Sequence, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """Take the token sampled for ``seq`` (and its log-probabilities, when asked) and send what it
        produced; finish it when it is done."""
        params = seq.request.params
        if not 0 <= token < self.model.vocab_size:  # e.g. NaN logits: this request fails, the others go on
            log.error("sampling failed for %s: token %d", seq.request.request_id, token)
            self._finish(seq, "error", error="sampling failed")
            return
        grammar = seq.grammar
        if seq.reasoning:  # still reasoning: the grammar starts after the token that ends it
            seq.reasoning, grammar = token != params.reasoning_end, None
            seq.reasoning_tokens += seq.reasoning
            self._constrained += constraint_change(seq)  # (a thinking budget near, or the reasoning over)
        elif grammar is not None and not grammar.accept(token):
            self._finish(seq, "error", error=f"structured output: token {token} is not in the grammar {grammar.error}")
            return
        output = seq.output
        output.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        if logprobs is not None:
            seq.unsent_logprobs = seq.unsent_logprobs or []
            seq.unsent_logprobs.append(logprobs)
        # (a complete grammar ends at EOS, also ignoring EOS; a stop token is vLLM's stop_reason, EOS is not)
        eos = token in self.eos_ids and (not params.ignore_eos or (grammar is not None and grammar.complete))
        if eos or token in params.stop_token_ids:
            seq.stop_reason = None if eos else token
            self._finish(seq, "stop", text=flush_text(seq))
            return
        text = seq.detokenizer.push(token)
        stopped = False
        if seq.stop.stop and len(output) >= params.min_tokens:  # stop strings to look for (most requests have none)
            text, stopped = seq.stop.push(text)
        if stopped:
            self._finish(seq, "stop", text=text)
        elif len(output) >= seq.max_tokens or seq.prompt_len + len(output) >= self.model.max_context:
            tail, stopped = seq.stop.push(seq.detokenizer.flush())
            text += tail if stopped else tail + seq.stop.flush()
            self._finish(seq, "stop" if stopped else "length", text=text)
        elif self._stream_interval == 1:
            self._send(seq, Event(seq.request.request_id, text=text, new_tokens=1,
                                  logprobs=seq.take_logprobs() if seq.unsent_logprobs or seq.prompt_logprobs else None))
        else:  # the first token at once (time to first token), then every stream_interval-th
            held = seq.unsent_tokens + 1
            if held >= self._stream_interval or len(output) == 1:
                self._send(seq, Event(seq.request.request_id, text=seq.unsent_text + text, new_tokens=held,
                                      logprobs=seq.take_logprobs()))
                seq.unsent_text, seq.unsent_tokens = "", 0
            else:
                seq.unsent_text += text
                seq.unsent_tokens = held

    def _finish(self, seq: _Sequence, reason: str, text: str = "", error: str | None = None) -> None:
        """Send the last event, free the sequence's cache (once no launched step
        writes it any more)."""
        self._by_request.pop(seq.request.request_id, None)
        seq.finished = True
        seq.grammar = None
        if seq.constrained:
            seq.constrained = False
            self._constrained -= 1
        if self.config.prefix_caching and seq.holds_blocks and reason != "error":
            publish_known(self.pool, seq)
        if seq.admitted:
            if self._running.pop(seq.seq_id, None) is not None:
                self._kv_tokens_used -= seq.computed
            self._release_if_idle(seq)
        else:
            self._waiting.remove(seq)  # (False: already out of the queue)
        # the finishing token (stop, length), after the tokens held for the next event
        produced = seq.unsent_tokens + (1 if reason in ("stop", "length") and seq.output else 0)
        fields = (seq.request.request_id, seq.unsent_text + text, produced, reason, seq.prompt_len, len(seq.output),
                  error, seq.take_logprobs(), usage_details(seq, self.config.prefix_caching))  # Event's, in order
        self._send(seq, Event(*fields))

    def _release_if_idle(self, seq: _Sequence) -> None:
        """Return a finished sequence's blocks, unless a launched step still writes them."""
        if seq.steps_in_flight > 0 or not seq.holds_blocks:
            return
        seq.holds_blocks = False
        self.pool.free(seq.seq_id)
        self._release_model(seq)

    def _release_model(self, seq: _Sequence) -> None:
        try:
            self.model.release(seq.seq_id)
        except Exception:  # a failed release must not take the other requests down
            log.exception("model.release(%d) failed", seq.seq_id)

    def _send(self, seq: _Sequence, event: Event) -> None:
        """Hand an event to its sink — with the output ids produced since the last one where the request asks for
        them (vLLM's ``return_token_ids``: the one that ended it too) —; a broken sink (consumer gone) cancels
        the request."""
        if seq.returns_ids:
            event = with_token_ids(event, tuple(seq.output[seq.ids_sent:]))
            seq.ids_sent = len(seq.output)
        try:
            seq.sink(event)
        except Exception:
            log.warning("event sink of %s failed; cancelling it", seq.request.request_id, exc_info=True)
            if not event.finished:
                self.cancel(seq.request.request_id)

    def _update_load(self) -> None:
        pool = self.pool
        self._load = RankLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens_budget=pool.capacity_tokens(),
            kv_tokens_used=self._kv_tokens_used,
            kv_blocks_total=pool.usable_blocks,
            kv_blocks_used=pool.used_blocks,
            kv_cache_bytes=self.model.kv_cache_bytes,
            prefix_query_tokens=pool.query_tokens,
            prefix_hit_tokens=pool.hit_tokens,
            preemptions=self._preemptions,
        )
