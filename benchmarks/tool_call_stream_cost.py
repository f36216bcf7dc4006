"""What streaming a reply's tool calls as they are written costs the API process: the product's
:class:`~vexpert_runtime.serve.tool_call_stream.ToolCallStream` fed a reply 4 characters at a time (about a token),
per format — a DeepSeek-V3 call and a Qwen3-Coder call each carrying a 20 KB file, a hermes call with the same, and
20 short DeepSeek-V3 calls — µs per push (the median of 5 runs), checked against the whole reply's calls.

    .venv/bin/python benchmarks/tool_call_stream_cost.py

Results: ``results/tool_call_stream_cost_cpu.txt``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.serve.tool_call_stream import ToolCallStream
from vexpert_runtime.serve.tool_calls import TypedToolFormat, parse_tool_calls

BEGIN, CALL, SEP, CALL_END, END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                   "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
FILE = "def f(x):\n    return x * 2  # comment\n" * 500
WRITE = {"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "text": {"type": "string"}}}}}


def cases() -> list[tuple[str, object, str]]:
    """(name, parser, reply)."""
    args = json.dumps({"path": "a.py", "text": FILE})
    small = f'{CALL}function{SEP}f\n```json\n{{"x": 1}}\n```{CALL_END}'
    xml = (f"<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=text>\n{FILE}\n"
           "</parameter>\n</function>\n</tool_call>")
    return [
        ("deepseek_v3, one 20 KB call", "deepseek_v3", f"{BEGIN}{CALL}function{SEP}write\n```json\n{args}\n```{CALL_END}{END}"),
        ("qwen3_coder, one 20 KB call", TypedToolFormat.of("qwen3_coder", [WRITE]), xml),
        ("hermes, one 20 KB call", "hermes", "<tool_call>" + json.dumps({"name": "write", "arguments": {"text": FILE}})
         + "</tool_call>"),
        ("deepseek_v3, 20 short calls", "deepseek_v3", f"ok{BEGIN}{small * 20}{END}"),
    ]


def stream_us_per_push(parser: object, text: str) -> tuple[float, int]:
    stream, joined = ToolCallStream(parser), {}  # type: ignore[arg-type]
    pushes = 0
    start = time.perf_counter()
    for at in range(0, len(text), 4):
        _, deltas = stream.push(text[at:at + 4])
        pushes += 1
        for delta in deltas:
            joined[delta.index] = joined.get(delta.index, "") + delta.arguments
    _, deltas, calls = stream.finish()
    elapsed = time.perf_counter() - start
    for delta in deltas:
        joined[delta.index] = joined.get(delta.index, "") + delta.arguments
    whole = [c.arguments for c in parse_tool_calls(parser, text)[1]]  # type: ignore[arg-type]
    assert [joined[i] for i in sorted(joined)] == [c.arguments for c in calls] == whole
    return elapsed / pushes * 1e6, pushes


def main() -> int:
    for name, parser, text in cases():
        runs = [stream_us_per_push(parser, text) for _ in range(5)]
        print(json.dumps({"case": name, "chars": len(text), "pushes": runs[0][1],
                          "us_per_push": round(statistics.median(r[0] for r in runs), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
