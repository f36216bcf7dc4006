"""vexpert's tool-call parsers beside vLLM's on the same replies, offline: ``qwen3_coder`` (Qwen3-Coder's XML calls,
whose arguments the request's tools type), ``hermes``, ``deepseek_v3``, ``deepseek_v31`` and ``kimi_k2`` (their
markers made special tokens of the tokenizer, as in those models') — each case's content and calls from ``serve/tool_calls.py``
(:func:`parse_tool_calls`, what ``vexpert serve --tool-call-parser …`` runs)
and from vLLM's own parser class (``vllm.tool_parsers``, its ``extract_tool_calls``), run in vLLM's virtual environment
(``--vllm-python``; it reads the demo model's tokenizer) — and streamed a token at a time (the demo tokenizer's
tokens; vLLM's ``extract_tool_calls_streaming``, vexpert's ``ToolCallStream``), each call's deltas joined as a client
joins them, and counted: how many pieces of its arguments went out before the reply ended (``argument_pieces``: a
call sent whole at the end has none). Prints one row per case and whether the two agree.

    python benchmarks/tool_parser_parity.py --vllm-python /work/vllm-venv/bin/python --out out/tool_parser_parity.json

A live server comparison (``api_parity.py``) cannot reach these: no model we can run here writes these formats,
and vLLM cannot be given a scripted reply.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "integer"}}, "limit": {"type": ["number", "null"]},
    "zip": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "level": {"enum": [1, 2, 3]},
    "filters": {"type": "object"}, "ratio": {"anyOf": [{"type": "number"}, {"type": "string"}]},
    "free": {}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "ping"}}]


def _call(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (case, reply) — the values are the texts a model writes; what each becomes depends on the tool's schema
CASES = [
    ("typed values", "Checking.\n" + _call("get_weather", city="New York", days="3", metric="True",
                                           hours="[9, 12]", limit="2.5", zip="02134")),
    ("integral number, null, enums", _call("get_weather", limit="2.0", days="null", unit="c", level="2")),
    ("values their types do not fit", _call("get_weather", days="three", limit="inf", metric="yes",
                                            hours="not json", filters="{\"a\": 1}")),
    ("anyOf, untyped and undeclared", _call("get_weather", ratio="0.5", free="[1, 2]", extra="7")),
    ("two calls, multi-line text", _call("get_weather", city="  two\nlines ") + "\n" + _call("ping")),
    ("unknown tool", _call("other", n="1")),
    ("bool as 1 / 0", _call("get_weather", metric="0")),
    ("no call", "plain text, no call"),
    ("content before, trailing newline", "Let me look.\n\n" + _call("ping")),
    ("bare functions, no <tool_call>", "Sure.\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n"
                                       "<function=ping>\n</function>"),
]


BEGIN, END, CALL, CALL_END, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                   "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
        "<|tool_call_argument_begin|>")
LONG = json.dumps({"path": "a.py", "text": "def f(x):\n    return x * 2\n" * 6})
# parser → (its markers, special tokens in the model's tokenizer; its cases)
FORMATS: dict[str, tuple[tuple[str, ...], list[tuple[str, str]]]] = {
    "qwen3_coder": ((), CASES),
    "hermes": (("<tool_call>", "</tool_call>"), [
        ("two calls", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'),
        ("compact JSON, non-ASCII", '<tool_call>{"name":"get_weather","arguments":{"city":"Zürich","days":3}}</tool_call>'),
        ("long arguments", f'<tool_call>\n{{"name": "write", "arguments": {LONG}}}\n</tool_call>'),
        ("no call", "plain text, no call")]),
    "deepseek_v3": ((BEGIN, END, CALL, CALL_END, SEP), [
        ("two calls", f'Let me check.{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CALL_END}\n'
                      f'{CALL}function{SEP}ping\n```json\n{{}}\n```{CALL_END}{END}'),
        ("long arguments", f"{BEGIN}{CALL}function{SEP}write\n```json\n{LONG}\n```{CALL_END}{END}"),
        ("spaced JSON", f'{BEGIN}{CALL}function{SEP}f\n```json\n{{ "a" : [1, 2],\n "b":"x" }}\n```{CALL_END}{END}'),
        ("no call", "plain text, no call")]),
    "deepseek_v31": ((BEGIN, END, CALL, CALL_END, SEP), [
        ("two calls", f'Let me check.{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris"}}{CALL_END}'
                      f'{CALL}ping{SEP}{{}}{CALL_END}{END}'),
        ("long arguments", f"{BEGIN}{CALL}write{SEP}{LONG}{CALL_END}{END}")]),
    "kimi_k2": (KIMI, [
        ("two calls", f'Let me check.{KIMI[0]}{KIMI[2]}functions.get_weather:0{KIMI[4]}{{"city": "Paris"}}{KIMI[3]}'
                      f'{KIMI[2]}functions.ping:1{KIMI[4]}{{}}{KIMI[3]}{KIMI[1]}'),
        ("long arguments", f"{KIMI[0]}{KIMI[2]}functions.write:0{KIMI[4]}{LONG}{KIMI[3]}{KIMI[1]}")]),
}


def _joined(joined: dict[int, list[str]], deltas: Any, name_of: Any, arguments_of: Any) -> None:
    for delta in deltas:
        entry = joined.setdefault(delta.index, ["", ""])
        entry[0] += name_of(delta) or ""
        entry[1] += arguments_of(delta) or ""


def _as_json(calls: list[list[str]]) -> list[tuple[str, Any]]:
    """Streamed calls' joined arguments as JSON values where they parse (the text where not)."""
    parsed = []
    for name, arguments in calls:
        try:
            parsed.append((name, json.loads(arguments)))
        except ValueError:
            parsed.append((name, arguments))
    return parsed


def vexpert_rows(parser_name: str, pieces: list[list[str]]) -> list[dict[str, Any]]:
    """Each case whole (``parse_tool_calls``) and streamed by ``pieces`` (``ToolCallStream``, the deltas joined)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from vexpert_runtime.serve.tool_call_stream import ToolCallStream
    from vexpert_runtime.serve.tool_calls import TypedToolFormat, parse_tool_calls

    fmt = TypedToolFormat.of(parser_name, TOOLS) if parser_name == "qwen3_coder" else parser_name
    rows = []
    for (name, text), case_pieces in zip(FORMATS[parser_name][1], pieces, strict=True):
        content, calls = parse_tool_calls(fmt, text)
        stream, sent, joined, early = ToolCallStream(fmt), "", {}, {}
        for piece in case_pieces:
            more, deltas = stream.push(piece)
            sent += more
            _joined(joined, deltas, lambda d: d.name, lambda d: d.arguments)
            for delta in deltas:
                early[delta.index] = early.get(delta.index, 0) + bool(delta.arguments)
        tail, deltas, _ = stream.finish()
        _joined(joined, deltas, lambda d: d.name, lambda d: d.arguments)
        rows.append({"case": name, "content": content if calls else text,
                     "calls": [[c.name, json.loads(c.arguments)] for c in calls],
                     "streamed": {"content": sent + tail, "calls": [joined[i] for i in sorted(joined)],
                                  "argument_pieces": [early.get(i, 0) for i in sorted(joined)]}})
    return rows


VLLM_SIDE = """
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager
parser_name, markers, cases, tools, tokenizer = json.loads(sys.stdin.read())
tok = AutoTokenizer.from_pretrained(tokenizer)
if markers:  # the format's markers are special tokens in the model's tokenizer, as in DeepSeek's and Kimi's
    tok.add_special_tokens({"additional_special_tokens": markers})
request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools)
parser_cls = ToolParserManager.get_tool_parser(parser_name)
rows = []
for name, text in cases:
    got = parser_cls(tok, request.tools).extract_tool_calls(text, request)
    row = {"case": name, "content": got.content if got.tools_called else text,
           "calls": [[c.function.name, json.loads(c.function.arguments)] for c in got.tool_calls]}
    # streamed a token at a time (the demo tokenizer's tokens), the deltas joined per call as a client joins them
    parser = parser_cls(tok, request.tools)
    ids = tok.encode(text, add_special_tokens=False)
    before, pieces, deltas, sent = "", [], [], 0
    for end in range(1, len(ids) + 1):
        now = tok.decode(ids[:end])
        if now.endswith("\ufffd") and end < len(ids):
            continue  # a character cut between tokens: wait for the rest of it (as a server's detokenizer does)
        pieces.append(now[len(before):])
        delta = parser.extract_tool_calls_streaming(before, now, now[len(before):], ids[:sent], ids[:end],
                                                    ids[sent:end], request)
        sent = end
        if delta is not None:
            deltas.append(delta)
        before = now
    last = parser.finish_streaming() if hasattr(parser, "finish_streaming") else None
    deltas += [last] if last is not None else []
    content, joined, early = "", {}, {}
    for delta in deltas:
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if delta is not last:
                early[call.index] = early.get(call.index, 0) + bool(call.function and call.function.arguments)
            entry = joined.setdefault(call.index, ["", ""])
            entry[0] += (call.function.name or "") if call.function else ""
            entry[1] += (call.function.arguments or "") if call.function else ""
    row["pieces"] = pieces
    row["streamed"] = {"content": content, "calls": [[joined[i][0], joined[i][1]] for i in sorted(joined)],
                       "argument_pieces": [early.get(i, 0) for i in sorted(joined)]}
    rows.append(row)
print("ROWS " + json.dumps(rows))
"""


def vllm_rows(python: str, tokenizer: str, parser_name: str) -> list[dict[str, Any]]:
    markers, cases = FORMATS[parser_name]
    done = subprocess.run([python, "-c", VLLM_SIDE], input=json.dumps([parser_name, markers, cases, TOOLS, tokenizer]),
                          text=True, capture_output=True, timeout=600, check=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("ROWS "))
    return json.loads(line[5:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="the python of a virtual environment with vLLM")
    parser.add_argument("--tokenizer", default="/tmp/vexpert-demo-model", help="a tokenizer directory vLLM can load")
    parser.add_argument("--parsers", nargs="+", choices=sorted(FORMATS), default=sorted(FORMATS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (Path(args.tokenizer) / "tokenizer.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
        from vexpert_runtime.serve.demo_model import ensure_demo_model

        ensure_demo_model(Path(args.tokenizer))
    results = {}
    for parser_name in args.parsers:
        theirs = vllm_rows(args.vllm_python, args.tokenizer, parser_name)
        ours = vexpert_rows(parser_name, [row.pop("pieces") for row in theirs])
        rows = []
        for mine, other in zip(ours, theirs, strict=True):
            whole = {k: mine[k] for k in ("content", "calls")} == {k: other[k] for k in ("content", "calls")}
            row = {"case": mine["case"], "agree": whole,
                   "streamed_calls_agree": _as_json(mine["streamed"]["calls"]) == _as_json(other["streamed"]["calls"]),
                   "streamed_arguments_as_sent": mine["streamed"]["calls"] == other["streamed"]["calls"],
                   "streamed_content_agree": mine["streamed"]["content"] == other["streamed"]["content"],
                   "vexpert": mine, "vllm": other}
            rows.append(row)
            print(parser_name, json.dumps(row, ensure_ascii=False))
        print(f"{parser_name}: whole replies {sum(r['agree'] for r in rows)} of {len(rows)} agree; streamed: calls "
              f"{sum(r['streamed_calls_agree'] for r in rows)} (their arguments' text "
              f"{sum(r['streamed_arguments_as_sent'] for r in rows)}), content "
              f"{sum(r['streamed_content_agree'] for r in rows)}; pieces of arguments sent before the reply ended: "
              f"vexpert {sum(sum(r['vexpert']['streamed']['argument_pieces']) for r in rows)}, vLLM "
              f"{sum(sum(r['vllm']['streamed']['argument_pieces']) for r in rows)}")
        results[parser_name] = rows
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
