"""The API process's prompts as token ids: completion prompts, chat conversations through the model's template,
``bad_words``, and token ids back to text.

A Hugging Face fast tokenizer is not safe to share across threads (its encode reconfigures the Rust tokenizer,
which another thread may be running), so there are two: the event loop's own copy for short inputs (a hand-off to
a thread costs more than they do) and the tokenizer thread's for inputs over :data:`INLINE_TOKENIZE_CHARS` (one long
prompt must not stall every stream)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from vexpert_runtime.serve import openai_api as oa
from vexpert_runtime.serve.api_errors import ApiError

log = logging.getLogger(__name__)

# Prompts (or chat messages) up to this many characters are tokenized on the event loop (0.5 ms for
# 330 characters with the demo tokenizer on the 2-core dev machine): on the tokenizer thread the same
# prompt waited for the GIL behind a busy loop — 5.5-6.6 ms at API_SWITCH_INTERVAL_S, beyond 5 s at the
# default interval (benchmarks/gil_handoff.py). Longer prompts still go to the thread, so one long
# prompt cannot stall every stream.
INLINE_TOKENIZE_CHARS = 2048

_Result = TypeVar("_Result")


class PromptEncoder:
    """Token ids of what requests send (``vocab_size``: a token-id prompt's ids must be below it). The methods
    taking ``tokenizer`` run with the calling thread's (default: the tokenizer thread's); :meth:`run` picks."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer  # the tokenizer thread's (long prompts)
        self.vocab_size = vocab_size
        try:
            self.loop_tokenizer: Any = copy.deepcopy(tokenizer)  # the event loop's (short prompts)
        except Exception as exc:  # a tokenizer that cannot be copied: every prompt goes to the thread
            log.info("tokenizer not copyable (%r): every prompt is tokenized on the tokenizer thread", exc)
            self.loop_tokenizer = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="vexpert-tokenize")  # one: see the module's text
        self._single: dict[str, int | None] = {}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, encode: Callable[..., _Result], prompt: Any, chars: int) -> _Result:
        """``encode(prompt, tokenizer)``: up to ``INLINE_TOKENIZE_CHARS`` on the loop with its own tokenizer (no
        hand-off), else on the tokenizer thread (:meth:`off_loop`)."""
        if self.loop_tokenizer is not None and chars <= INLINE_TOKENIZE_CHARS:
            return encode(prompt, self.loop_tokenizer)
        return await self.off_loop(encode, prompt)

    async def off_loop(self, encode: Callable[[Any], _Result], prompt: Any) -> _Result:
        """Run ``encode(prompt)`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, encode, prompt)

    async def text(self, ids: Sequence[int]) -> str:
        """Token ids as text (an echoed prompt, ``/detokenize``)."""
        if self.loop_tokenizer is not None and len(ids) <= INLINE_TOKENIZE_CHARS:
            return str(self.loop_tokenizer.decode(list(ids)))
        return str(await self.off_loop(self.tokenizer.decode, list(ids)))

    def single_token(self, text: str) -> int | None:
        """The id of the one token ``text`` is (a marker such as ``</think>``), None where it is several."""
        if text not in self._single:
            ids = (self.loop_tokenizer or self.tokenizer).encode(text, add_special_tokens=False)
            self._single[text] = ids[0] if len(ids) == 1 else None
        return self._single[text]

    def prompt_ids(self, prompt: str | list[int], tokenizer: Any = None, add_special_tokens: bool = True
                   ) -> list[int]:
        """Token ids of a completion prompt: a text tokenized, token ids checked (a 400 naming ``prompt``)."""
        if isinstance(prompt, str):
            return list((tokenizer or self.tokenizer).encode(prompt, add_special_tokens=add_special_tokens))
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise ApiError(400, f"prompt: token ids must be in [0, {self.vocab_size})", param="prompt")
        return prompt

    def bad_words(self, words: list[str], tokenizer: Any = None) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as the token sequences they ban (:func:`bad_word_ids`)."""
        return bad_word_ids(words, tokenizer or self.tokenizer)

    def chat_ids(self, inputs: oa.ChatTemplateInputs, tokenizer: Any = None, add_special_tokens: bool = False,
                 chat_template: str | None = None) -> list[int]:
        """Render the chat template (with the request's tools, documents and template variables), then tokenize
        (the template already holds the special tokens: ``add_special_tokens`` adds the tokenizer's own too);
        ``chat_template``: the server's own (``--chat-template``) instead of the model's."""
        tokenizer = tokenizer or self.tokenizer
        try:
            text = tokenizer.apply_chat_template(
                [m.as_template_input() for m in inputs.messages], tokenize=False, chat_template=chat_template,
                **inputs.template_arguments()
            )
        except Exception as exc:  # templates raise for conversations they reject (e.g. roles out of order)
            log.info("chat template rejected a conversation: %r", exc)
            raise ApiError(400, "messages: the model's chat template rejects this conversation (e.g. roles out of "
                           "the order it expects, or a role it does not know); reorder or merge the messages",
                           param="messages") from None
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def bad_word_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The token sequences of a request's ``bad_words``, as vLLM forms them: each word (its leading whitespace
    stripped) as it starts a text, and after a space where that tokenizes to as many tokens with a different first
    one (the word in the middle of a text)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return tuple(sequences)


def special_tokens(tokenizer: Any) -> frozenset[str]:
    """The tokenizer's special tokens' texts, as llguidance tells them (added tokens marked special)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(str(added.content) for added in decoder.values() if getattr(added, "special", False))
