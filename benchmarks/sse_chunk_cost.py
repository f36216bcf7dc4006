"""What one streamed text chunk costs the API process to serialize: the whole chunk JSON-encoded
(:func:`~vexpert_runtime.serve.api._sse` of ``openai_api.completion_chunk``, as every chunk was until the
sixth session of 2026-12-05) against the product's per-choice frame (:func:`~vexpert_runtime.serve.api._text_frame`,
encoded once per stream) around ``json.dumps(text)``. Checks both give the same bytes, prints µs per chunk.

    python benchmarks/sse_chunk_cost.py

Results: ``results/sse_chunk_cost.txt``.
"""

from __future__ import annotations

import json
import timeit

from vexpert_runtime.serve import openai_api as oa
from vexpert_runtime.serve.api import _TEXT_MARK, _sse, _text_frame

RID, CREATED, MODEL = "cmpl-0123456789abcdef0123456789abcdef", 1764900000, "deepseek-v3"


def whole(text: str) -> bytes:
    return _sse(oa.completion_chunk(RID, CREATED, MODEL, text))


def main() -> int:
    frame = _text_frame(oa.completion_chunk(RID, CREATED, MODEL, _TEXT_MARK))
    assert frame is not None
    before, after = frame

    def framed(text: str) -> bytes:
        return b"".join((before, json.dumps(text, ensure_ascii=False).encode(), after))

    for text in (" fox", 'a "quoted"\n', "\u4e2d\U0001f600"):
        assert framed(text) == whole(text)
    n = 200_000
    for name, fn in (("whole chunk encoded", whole), ("frame + json.dumps(text)", framed)):
        best = min(timeit.repeat(lambda fn=fn: fn(" fox"), number=n, repeat=5)) / n * 1e6
        print(f"{name}: {best:.2f} µs per chunk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
