"""Reasoning parsers (vLLM's ``--reasoning-parser``): a thinking model's chat reply split into its reasoning — between
``<think>`` and ``</think>`` — and its content, as vLLM returns them (``message.reasoning`` beside
``message.content``; streamed, ``delta.reasoning`` chunks before the content's).

Whether a reply starts in its reasoning is the model's: DeepSeek-R1 always thinks (its template opens ``<think>``);
Qwen3 and Kimi K2 think unless the request's ``chat_template_kwargs`` turn it off (``enable_thinking`` / ``thinking``
false); DeepSeek-V3.1 thinks only when they turn it on. The rendered prompt has the last word: one that ends with the
end marker (Qwen3's ``<think>\\n\\n</think>\\n\\n`` without thinking, V3.1's ``</think>``) starts in the content, one
that ends with the start marker in the reasoning. A reply that never closes its reasoning is all reasoning; a stray
end marker after the reasoning is dropped (a reply that started in its content keeps every character); a tool call's
first marker ends the reasoning and stays in the content (where the tool-call parser reads it), as vLLM's Qwen3 and
Kimi K2 parsers do.

The rank counts a reply's reasoning tokens — those before the end-of-reasoning token
(:attr:`~.events.SamplingParams.reasoning_end`) — for the usage's ``completion_tokens_details``, and structured output
waits for that token (vLLM's ``reasoning_ended``): the grammar constrains the content only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

# ``vexpert serve --reasoning-parser``, ``spec.runtime.reasoningParser`` (vLLM's names)
ReasoningParser = Literal["deepseek_r1", "deepseek_v3", "qwen3", "kimi_k2"]


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its reasoning: ``start`` / ``end`` markers, whether it thinks when the request says
    nothing (``thinks_by_default``; ``switchable``: the template kwargs ``enable_thinking`` / ``thinking`` decide
    where given), and markers that end the reasoning implicitly and stay in the content (a tool call's start)."""

    name: str
    thinks_by_default: bool
    switchable: bool = True
    implicit_ends: tuple[str, ...] = ()
    start: str = "<think>"
    end: str = "</think>"

    def thinks(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the reply starts in its reasoning by the request's template variables (vLLM's rule per parser)."""
        kwargs = template_kwargs or {}
        given = [kwargs[key] for key in ("enable_thinking", "thinking") if kwargs.get(key) is not None]
        if not self.switchable or not given:
            return self.thinks_by_default
        return any(bool(value) for value in given)

    def starts_in_reasoning(self, template_kwargs: Mapping[str, Any] | None, prompt_text: str) -> bool:
        """Where the reply starts: the prompt's last marker decides where it ends with one, else :meth:`thinks`."""
        tail = prompt_text.rstrip()
        if tail.endswith(self.end):
            return False
        if tail.endswith(self.start):
            return True
        return self.thinks(template_kwargs)


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", thinks_by_default=True, switchable=False),
    "deepseek_v3": ReasoningFormat("deepseek_v3", thinks_by_default=False,
                                   implicit_ends=("<｜tool▁calls▁begin｜>",)),
    "qwen3": ReasoningFormat("qwen3", thinks_by_default=True, implicit_ends=("<tool_call>",)),
    "kimi_k2": ReasoningFormat("kimi_k2", thinks_by_default=True, implicit_ends=("<|tool_calls_section_begin|>",)),
}


assert set(REASONING_PARSERS) == set(get_args(ReasoningParser))


@dataclass(frozen=True)
class ReplyReasoning:
    """How a chat request's replies split: their format, whether they start in the reasoning, whether the answer shows
    the reasoning (vLLM's ``include_reasoning``; the split happens all the same)."""

    fmt: ReasoningFormat
    in_reasoning: bool
    shown: bool = True


class ReasoningStream:
    """One reply's text, as it arrives, split into reasoning and content (:meth:`push` each piece, :meth:`finish` at
    the end). A piece that ends with the first characters of a marker is held back until the next one tells."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        self.in_reasoning = in_reasoning
        self.reasoned = in_reasoning  # the reply had a reasoning part (None, not "", when it had none)
        self._pending = ""
        self._opened = False  # the reasoning's leading start marker is behind us (or was never written)
        self._markers = (fmt.start, fmt.end, *fmt.implicit_ends)

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and the content ``text`` adds (either may be "")."""
        buffer, self._pending = self._pending + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buffer:
            if self.in_reasoning:
                if not self._opened:  # a leading start marker (a model that writes its own) is dropped
                    stripped = buffer.lstrip()
                    if stripped.startswith(self.fmt.start):
                        buffer, self._opened = stripped[len(self.fmt.start):], True
                        continue
                    if not stripped or self.fmt.start.startswith(stripped):
                        self._pending = buffer  # whitespace, or the start marker's beginning: wait
                        break
                    self._opened = True
                cut, marker = _first_marker(buffer, (self.fmt.end, *self.fmt.implicit_ends))
                if marker is None:
                    kept = _held_back(buffer, self._markers)
                    reasoning.append(buffer[: len(buffer) - kept])
                    self._pending = buffer[len(buffer) - kept:]
                    break
                reasoning.append(buffer[:cut])
                self.in_reasoning = False
                # the end marker goes; an implicit end (a tool call's start) is the content's first text
                buffer = buffer[cut + len(marker):] if marker == self.fmt.end else buffer[cut:]
            else:
                cut = buffer.find(self.fmt.end) if self.reasoned else -1  # (a reply that never reasoned: all text)
                if cut < 0:
                    kept = _held_back(buffer, (self.fmt.end,)) if self.reasoned else 0
                    content.append(buffer[: len(buffer) - kept])
                    self._pending = buffer[len(buffer) - kept:]
                    break
                content.append(buffer[:cut])  # a stray end marker in the content: dropped
                buffer = buffer[cut + len(self.fmt.end):]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back: the reply ended, so it is text, not a marker."""
        pending, self._pending = self._pending, ""
        if not pending:
            return "", ""
        return (pending, "") if self.in_reasoning else ("", pending)


def split_reasoning(fmt: ReasoningFormat, in_reasoning: bool, text: str) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content), None for a part it does not have (vLLM's non-streamed answer)."""
    stream = ReasoningStream(fmt, in_reasoning)
    reasoning, content = stream.push(text)
    tail_reasoning, tail_content = stream.finish()
    reasoning, content = reasoning + tail_reasoning, content + tail_content
    return (reasoning if stream.reasoned else None), (content or None)


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest of ``markers`` in ``text``: (its index, it), else (−1, None)."""
    found = [(text.find(marker), marker) for marker in markers if marker and marker in text]
    return min(found) if found else (-1, None)


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many of ``text``'s last characters begin one of ``markers`` (to hold until the next piece)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest
