"""What structured output costs a rank's host: reading the tokenizer once, and each step's grammar masks.

The product's :class:`~vexpert_runtime.serve.structured_output.GrammarTokens` on a synthetic byte-level BPE tokenizer
of ``--vocab`` tokens (DeepSeek-V3's and Qwen's are ~128k-152k; no real one is stored here, and none can be fetched on
the GPU host): the time to read it (its thread, from a rank's start), then ``--sequences`` constrained sequences
following one JSON schema token by token — per step, :meth:`GrammarTokens.allowed` (one call, llguidance's threads)
against one ``fill_next_token_bitmask`` per sequence (what a loop over the rows would do).

    python benchmarks/grammar_mask_cost.py --vocab 128000 --sequences 1 16 64 256 --out benchmarks/results/grammar_mask_cost.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
TEXT = '{"name": "abc def ghi", "age": 12, "tags": ["x", "yy", "zzz", "abcabc"]}'


def synthetic_tokenizer(directory: Path, vocab: int, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer (GPT-2's byte alphabet) with ``vocab`` tokens: the 256 bytes, JSON's pieces, and
    random letter runs, half of them with a leading space — the shape of a real vocabulary's trie, not its merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    pieces = {"".join(chars[b] for b in text.encode()) for text in ('{"', '":', '",', '"}', ' "', ", ", "[", "]", "12")}
    rng = random.Random(seed)
    syllables = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 3)))
                 for _ in range(3000)]
    table = {chars[b]: b for b in range(256)}
    for piece in sorted(pieces):
        table.setdefault(piece, len(table))
    while len(table) < vocab:
        word = ("Ġ" if rng.random() < 0.5 else "") + "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        table.setdefault(word, len(table))
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    import llguidance.torch
    import torch

    from vexpert_runtime.serve.structured_output import GrammarRequest, GrammarTokens, compile_grammar

    with tempfile.TemporaryDirectory() as directory:
        tokenizer = synthetic_tokenizer(Path(directory), args.vocab)
    started = time.perf_counter()
    grammars = GrammarTokens(tokenizer, args.vocab, [tokenizer.eos_token_id])
    grammar = compile_grammar(GrammarRequest("json", SCHEMA, "bench"))
    grammars.matcher(grammar)  # waits for the reader thread
    read_s = time.perf_counter() - started
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rows: list[dict[str, Any]] = []
    for count in args.sequences:
        batched, looped = [grammars.matcher(grammar) for _ in range(count)], [grammars.matcher(grammar) for _ in range(count)]
        batch_s, loop_s = [], []
        for step, token in enumerate(ids):
            for which in ((0, 1) if step % 2 else (1, 0)):  # alternate which goes first (caches, the other jobs)
                t0 = time.perf_counter()
                if which == 0:
                    grammars.allowed(batched)
                else:
                    mask = torch.empty(count, (args.vocab + 31) // 32 + 1, dtype=torch.int32)
                    for row, matcher in enumerate(looped):
                        llguidance.torch.fill_next_token_bitmask(matcher.ll_matcher, mask, row)
                (batch_s if which == 0 else loop_s).append(time.perf_counter() - t0)
            for matcher in (*batched, *looped):
                assert matcher.accept(token)
        row = {"sequences": count, "steps": len(ids), "allowed_ms_mean": round(statistics.mean(batch_s) * 1e3, 3),
               "allowed_ms_max": round(max(batch_s) * 1e3, 3), "loop_ms_mean": round(statistics.mean(loop_s) * 1e3, 3),
               "loop_ms_max": round(max(loop_s) * 1e3, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"argv": sys.argv, "vocab": args.vocab, "tokenizer_read_s": round(read_s, 2), "rows": rows}
    print(json.dumps({"tokenizer_read_s": result["tokenizer_read_s"]}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
