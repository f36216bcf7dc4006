"""Structured output: the tokens a constrained sequence may sample next, from a grammar (llguidance).

A request that asks for JSON (a schema, or any object), a regex, one of several strings or a Lark grammar
(vLLM's ``structured_outputs``, OpenAI's ``response_format``) is compiled once, in the API process, into
an llguidance grammar (:func:`compile_grammar`: a bad schema or pattern is a 400 naming the field); the rank
that runs it keeps a :class:`GrammarMatcher` per sequence, which advances over each sampled token; each step the
constrained rows get the tokens they may take as bitmasks, in one call llguidance runs on its threads
(:meth:`GrammarTokens.allowed`). The model adds −inf to
the logits of every other token (:func:`unpack_allowed`, through the sequence's logit-bias row,
:mod:`.penalties`), so every sampling mode — greedy, temperature, min-p, top-k, top-p — draws only tokens
the grammar accepts; once the grammar is complete only EOS is allowed.

llguidance (Microsoft's, Rust, no dependencies, ~3 MB) is one of vLLM's and SGLang's structured-output
backends: the masks are the ones vLLM's ``guidance`` backend computes, with its defaults
(``whitespace_flexible`` unless ``disable_any_whitespace``). xgrammar, vLLM's default, pulls Triton and a
TVM runtime into every install (hundreds of MB on a CPU host).

Shapes: ``V`` the model's vocabulary (logits' width), ``W`` = ⌈V' / 32⌉ int32 words of a bitmask over
llguidance's vocabulary V' ≥ V (bit t % 32 of word t // 32: token t is allowed).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from vexpert_runtime.errors import VExpertInputError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True)
class GrammarRequest:
    """What a request constrains its output to: ``kind`` with its ``spec`` (a JSON schema as a dict or JSON
    text; a regex; the strings to choose from; a Lark / EBNF grammar; nothing for ``json_object``).
    ``field``: the request field that asked (named in errors). A structural tag's spec is vLLM's
    ``{"structures": [{"begin", "schema", "end"}, …], "triggers": […]}`` (:func:`structural_tag_grammar`)."""

    kind: GrammarKind
    spec: Any
    field: str
    whitespace_flexible: bool = True  # vLLM's default: not disable_any_whitespace
    closed_objects: bool = False  # vLLM's disable_additional_properties
    special_tokens: frozenset[str] = frozenset()  # the tokenizer's (a structural tag's trigger may be one)


_FIXES: dict[str, str] = {
    "json": "send a JSON schema (an object; llguidance's subset of draft 2020-12), or leave the field out",
    "json_object": "leave the field out",
    "regex": "send a regex in Rust's syntax (no lookaround, no backreferences), or leave the field out",
    "choice": "send a non-empty list of strings",
    "grammar": "send a Lark grammar whose rule 'start' is the whole output (or GBNF / EBNF), or leave the field out",
    "structural_tag": 'send {"structures": [{"begin": "<function=f>", "schema": {…}, "end": "</function>"}], '
                      '"triggers": ["<function="]}: each begin starts with a trigger',
}


def compile_grammar(request: GrammarRequest) -> str:
    """The llguidance grammar (serialized) for ``request``, checked: raises :class:`VExpertInputError`
    naming ``request.field`` for a schema, pattern or grammar llguidance cannot compile."""
    import llguidance

    defaults: JsonCompileOptions = {"whitespace_flexible": request.whitespace_flexible}
    try:
        if request.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
        elif request.kind == "json":
            schema = json.loads(request.spec) if isinstance(request.spec, str) else request.spec
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is an object")
            if request.closed_objects:
                schema = _closed_objects(copy.deepcopy(schema))
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        elif request.kind == "structural_tag":
            grammar = structural_tag_grammar(request)
        elif request.kind == "choice":
            if not request.spec or not all(isinstance(s, str) for s in request.spec):
                raise ValueError("choice is a non-empty list of strings")
            grammar = llguidance.grammar_from("choice", json.dumps(list(request.spec)))
        else:
            grammar = llguidance.grammar_from("regex" if request.kind == "regex" else "grammar", request.spec)
    except (ValueError, TypeError, KeyError) as exc:
        raise VExpertInputError(request.field, f"not a valid {request.kind.replace('_', ' ')}: {exc}",
                                _FIXES[request.kind]) from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise VExpertInputError(request.field, f"not a valid {request.kind.replace('_', ' ')}: {error.strip()}",
                                _FIXES[request.kind])
    return str(grammar)


def structural_tag_grammar(request: GrammarRequest) -> str:
    """vLLM's structural tag (its ``guidance`` backend's form: ``structures`` + ``triggers``) as an llguidance grammar:
    free text until a trigger, then the rest of a structure's ``begin``, JSON following its ``schema`` and its ``end``,
    then free text again (llguidance's :class:`~llguidance.StructTag`). A trigger written ``<…>`` that is one of the
    tokenizer's special tokens is matched as that token (vLLM's default); one that is not — Qwen's ``<tool_call>`` is an
    ordinary added token — as text, where vLLM's grammar fails. Each schema is passed as the schema itself, with the
    JSON options (vLLM passes its compiled grammar, which llguidance then reads as a schema of unknown keywords:
    any JSON)."""
    import llguidance

    spec = json.loads(request.spec) if isinstance(request.spec, str) else request.spec
    if not isinstance(spec, dict) or "format" in spec:
        raise ValueError("only the structures + triggers form is supported (xgrammar's 'format' form is not)")
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers is a non-empty list of non-empty strings")
    if not structures or not isinstance(structures, list):
        raise ValueError("structures is a non-empty list")
    special = {t for t in triggers if t in request.special_tokens and t.startswith("<") and t.endswith(">")}
    if special and any(t not in special and t.startswith("<") and t.endswith(">") for t in triggers):
        raise ValueError("triggers written <…> must all be special tokens of the tokenizer, or none of them")
    tags = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or not all(isinstance(structure.get(k), str) for k in ("begin", "end")):
            raise ValueError(f"structures[{i}] needs strings begin and end")
        schema = structure.get("schema", {})  # (vLLM's: none is any JSON)
        if not isinstance(schema, dict):
            raise ValueError(f"structures[{i}].schema is a JSON schema (an object)")
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{i}].begin {structure['begin']!r} starts with none of the triggers")
        schema = _closed_objects(copy.deepcopy(schema)) if request.closed_objects else schema
        options = {"x-guidance": {"whitespace_flexible": request.whitespace_flexible}}
        tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"], grammar={**schema, **options},
                                         end=structure["end"]))
    return str(llguidance.StructTag.to_grammar(tags, assume_special=bool(special)))


def _closed_objects(schema: Any) -> Any:
    """vLLM's ``disable_additional_properties``: every object schema with properties and no
    ``additionalProperties`` gets ``false`` (in place; returns it)."""
    if isinstance(schema, dict):
        for value in schema.values():
            _closed_objects(value)
        if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for item in schema:
            _closed_objects(item)
    return schema


class GrammarTokens:
    """A rank's tokenizer as llguidance sees it and the matchers of its sequences. llguidance reads the tokenizer
    once (0.62 s for a synthetic 128k-token vocabulary on the 2-core machine:
    ``benchmarks/grammar_mask_cost.py``)
    on a thread of its own from the rank's start, so a first constrained request does not stall the loop (and an
    EP group in lockstep) for that long. ``vocab_size``: the model's logits' width; ``eos_ids``: the tokens that end a
    sequence (what a complete grammar allows)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        # imported here, not on the reader thread: llguidance.hf imports transformers, and a thread importing it
        # while this one does too can hand either a half-initialised module ("cannot import name …")
        import llguidance.hf  # noqa: F401

        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._failure: Exception | None = None
        self._words = 0
        self._reader = threading.Thread(target=self._read, args=(tokenizer, sorted(eos_ids)), daemon=True,
                                        name="vexpert-grammar-tokens")
        self._reader.start()

    def _read(self, tokenizer: Any, eos: list[int]) -> None:
        try:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, max(self.vocab_size, len(tokenizer)), eos or None)
            self._words = (self._ll_tokenizer.vocab_size + 31) // 32
        except Exception as exc:  # e.g. not a fast tokenizer: only a constrained request fails, and says why
            self._failure = exc

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher for a sequence's grammar (``ValueError`` when llguidance reports one, or could not
        read the tokenizer)."""
        import llguidance

        self._reader.join()
        if self._failure is not None:
            raise ValueError(f"llguidance cannot read this tokenizer: {self._failure}")
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar)
        error = matcher.get_error()
        if error:
            raise ValueError(error)
        return GrammarMatcher(matcher)

    def allowed(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """The tokens each matcher's next draw may take: bitmasks [len(matchers), W] int32 on the CPU (only EOS
        once a grammar is complete), computed in parallel by llguidance's threads."""
        import llguidance
        import llguidance.torch

        if self._executor is None:  # its threads only on a rank that serves structured output
            self._executor = llguidance.LLExecutor()
        mask = torch.empty(len(matchers), self._words, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(m.ll_matcher, row) for row, m in enumerate(matchers)], mask)
        return mask


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, ll_matcher: Any) -> None:
        self.ll_matcher = ll_matcher

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False when the grammar does not allow it."""
        if self.ll_matcher.is_stopped():
            return True  # EOS after completion (a request that ignores EOS): nothing left to match
        return bool(self.ll_matcher.consume_token(token))

    @property
    def complete(self) -> bool:
        """Whether the grammar ended (it allows nothing but EOS, and nothing after it)."""
        return bool(self.ll_matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self.ll_matcher.get_error() or "")


def unpack_allowed(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmasks [C, W] int32 → allowed [C, vocab] bool (token t: bit t % 32 of word t // 32); runs where
    ``words`` is (graph-capturable)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


def pack_allowed(tokens: Iterable[int], vocab: int) -> torch.Tensor:
    """Token ids → a bitmask [⌈vocab / 32⌉] int32 on the CPU that allows exactly them (:func:`unpack_allowed`'s
    layout; ids in [0, vocab))."""
    ids = np.fromiter(tokens, dtype=np.int64)
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return torch.from_numpy(words.view(np.int32))
