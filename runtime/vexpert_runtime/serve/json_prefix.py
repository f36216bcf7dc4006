"""A JSON value as far as it is written, in the form the whole value takes once read and written again.

A ``hermes`` tool call's arguments are a JSON object inside the call's JSON; the whole reply gives them re-encoded
(``json.dumps(json.loads(…), ensure_ascii=False)``, as vLLM's parser does), so a stream that sent them as written
would not add up to the whole reply's arguments (``{"a":1}`` against ``{"a": 1}``). :func:`json_prefix` writes the
complete tokens of a value being written in that re-encoded form — separators as ``json.dumps`` writes them, strings
re-escaped, numbers once they end as ``json.dumps`` writes what they read as — so what it gives only grows as the
text does, and the finished value's gives exactly the whole reply's (an object with a key twice is the exception:
read whole, the last one wins). Partial-JSON parsers (partial_json_parser, which vLLM uses) close what is open, and
a closed prefix is not a prefix of what follows; hence this one, a tokenizer of ~60 lines whose strings are read by
``json`` (C).
"""

from __future__ import annotations

import json
import re

_TOKEN = re.compile(r'[ \t\n\r]*(?:([{}\[\],:])|(")|(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)'
                    r"|(true|false|null))")
_CONTROL_BYTES = bytes(range(32))  # raw in a string: json refuses them
_RE_ESCAPED = re.compile(r'\\[^"\\nrtbf]')  # an escape json.dumps writes otherwise (\/, \u00e9, …)
_SEPARATORS = {",": ", ", ":": ": "}
_LONGEST_ESCAPE = 6  # \uXXXX
_NUMBER_TAIL = "0123456789.eE+-"


def _closing_quote(text: str, at: int) -> int:
    """The index of the quote that closes the string whose body starts at ``at``, or ``len(text)`` (str.find: a
    string of kilobytes is read at C speed — a regex over it cost 45 µs per 10 KB)."""
    while (quote := text.find('"', at)) >= 0:
        if _backslashes_before(text, quote, at) % 2 == 0:
            return quote
        at = quote + 1
    return len(text)


def _backslashes_before(text: str, end: int, start: int) -> int:
    """How many backslashes ``text[start:end]`` ends with (odd: the character at ``end`` is escaped)."""
    at = end
    while at > start and text[at - 1] == "\\":
        at -= 1
    return end - at


def _string(text: str, at: int) -> tuple[str, int | None] | None:
    """The string token whose body starts at ``at`` (after its quote): (its re-encoded text — without the closing
    quote while it is open —, the index after it or None while open); None where it cannot be a JSON string."""
    end = _closing_quote(text, at)
    closed = end < len(text)
    body = text[at:end].encode("utf-8", "surrogatepass")
    if len(body.translate(None, _CONTROL_BYTES)) != len(body):  # (bytes.translate: 8x a regex's speed here)
        return None
    if _RE_ESCAPED.search(text, at, end) is None:  # written as json.dumps writes it (the usual case): as is
        whole = closed or _backslashes_before(text, end, at) % 2 == 0  # (else it ends in half an escape)
        return text[at - 1:end + closed - (not whole)], end + 1 if closed else None
    if closed:
        try:
            return json.dumps(json.loads(text[at - 1:end + 1]), ensure_ascii=False), end + 1
        except json.JSONDecodeError:  # an escape JSON has not (\x)
            return None
    raw = text[at:]  # open: decode as much as ends in a whole character (an escape may be cut)
    for cut in range(_LONGEST_ESCAPE + 1):
        try:
            decoded = json.loads('"' + raw[:len(raw) - cut] + '"')
        except json.JSONDecodeError:
            continue
        if decoded and "\ud800" <= decoded[-1] <= "\udbff":  # half of a surrogate pair: wait for the other
            decoded = decoded[:-1]
        return json.dumps(decoded, ensure_ascii=False)[:-1], None
    return None


def json_prefix(text: str, start: int = 0) -> tuple[str, int | None] | None:
    """The JSON value that begins at ``text[start:]`` (after any whitespace): (its complete tokens re-encoded as
    ``json.dumps(…, ensure_ascii=False)`` writes the whole value — a number or literal only once something follows
    it —, where the value ends in ``text`` or None while it is not complete); None where the text cannot be JSON."""
    out: list[str] = []
    stack: list[str] = []  # the open containers' closing brackets
    expect = "value"  # value, key, colon, next (a comma or the container's end); "first" flags an empty container
    first = False
    at = start
    while True:
        token = _TOKEN.match(text, at)
        if token is None:
            rest = text[at:].lstrip(" \t\n\r")
            whole = not rest or (expect == "value" and any(w.startswith(rest) for w in ("true", "false", "null")))
            return ("".join(out), None) if whole or rest[0] in "-0123456789" else None
        punct, quote, number, literal = token.groups()
        end = token.end()
        if quote is not None and expect in ("value", "key"):
            read = _string(text, end)
            if read is None:
                return None
            piece, end_or_open = read
            out.append(piece)
            if end_or_open is None:
                return "".join(out), None
            end, value = end_or_open, expect == "value"
            expect = "colon" if expect == "key" else "next"
        elif (number is not None or literal is not None) and expect == "value":
            if not text[end:].strip(_NUMBER_TAIL):  # it may go on (12 → 123, 1 → 1.5e3) where the text ends
                return "".join(out), None
            out.append(json.dumps(json.loads(number or literal)))
            value, expect = True, "next"
        elif punct in ("{", "[") and expect == "value":
            out.append(punct)
            stack.append("}" if punct == "{" else "]")
            expect, first, value = ("key" if punct == "{" else "value"), True, False
            at = end
            continue
        elif punct is not None and stack and punct == stack[-1] and (expect == "next" or (first and expect != "colon")):
            out.append(stack.pop())
            value, expect = True, "next"
        elif punct == "," and expect == "next" and stack:
            out.append(_SEPARATORS[","])
            expect, value = ("key" if stack[-1] == "}" else "value"), False
        elif punct == ":" and expect == "colon":
            out.append(_SEPARATORS[":"])
            expect, value = "value", False
        else:
            return None
        first = False
        at = end
        if value and not stack:
            return "".join(out), at
