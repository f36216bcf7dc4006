"""Regenerate ``runtime/vexpert_runtime/data/deepseek_v3_loads.json`` from the shared SGLang statistics.

The bundled file holds, for a few DeepSeek-V3 benchmark runs, each MoE layer's expert-load
distribution (dense layers 0-2 dropped) as probabilities × 1e6 (parts per million) rounded to 6
significant digits: ~117 KB per run instead of ~150 KB of raw counts, and small enough to ship.

    python benchmarks/make_bundled_loads.py            # rewrite the bundled file
    python benchmarks/make_bundled_loads.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE_DIR = REPO.parent / "shared" / "data" / "deepseek-v3"
OUTPUT = REPO / "runtime" / "vexpert_runtime" / "data" / "deepseek_v3_loads.json"
PHASES = ("decode_in1000out1000", "prefill_in4096", "decode_in500out1500")
VALUE_SCALE = 1_000_000
SIGNIFICANT_DIGITS = 6


def _trace_module() -> ModuleType:
    """Import :mod:`vexpert_runtime.simulation.trace`, from the source tree if the package is not installed."""
    try:
        from vexpert_runtime.simulation import trace
    except ImportError:
        sys.path.insert(0, str(REPO / "runtime"))
        from vexpert_runtime.simulation import trace
    return trace


def format_row(row: np.ndarray) -> str:
    """One layer as a JSON list of numbers with ``SIGNIFICANT_DIGITS`` significant digits."""
    return "[" + ",".join(format(float(v), f".{SIGNIFICANT_DIGITS}g") for v in row) + "]"


def phase_entry(path: Path) -> tuple[dict[str, object], list[str]]:
    """Metadata of one run and its ``[L, E]`` scaled distribution rows, formatted."""
    trace = _trace_module()
    counts = trace.read_logical_count(path)
    kept, dropped = trace.drop_dense_layers(counts)
    probs = trace.normalize_rows(kept) * VALUE_SCALE
    meta: dict[str, object] = {
        # The file name only: an absolute path would differ between checkouts and make the
        # bundled file depend on where ../shared happens to be mounted.
        "source": f"SGLang expert statistics of DeepSeek-V3, shared/data/deepseek-v3/{path.name}",
        "layers_dropped": dropped,
        "max_layer_total": round(float(kept.sum(axis=1).max())),
    }
    return meta, [format_row(r) for r in probs]


def render(source_dir: Path, phases: tuple[str, ...] = PHASES) -> str:
    """The whole bundled JSON document as text (one layer per line, stable output)."""
    header = {
        "format": "vexpert-expert-loads/1",
        "model": "DeepSeek-V3",
        "description": "Per-layer expert-load distributions of MoE layers; each row is a layer's "
        "probabilities x value_scale rounded to significant_digits (re-normalise on load).",
        "value_scale": VALUE_SCALE,
        "significant_digits": SIGNIFICANT_DIGITS,
        "generator": "benchmarks/make_bundled_loads.py",
    }
    parts = [json.dumps(header, indent=1)[:-2] + ',\n "distributions": {']
    entries = []
    for name in phases:
        meta, rows = phase_entry(source_dir / f"{name}.json")
        body = json.dumps(meta)[:-1] + ', "distribution": [\n' + ",\n".join(rows) + "\n]}"
        entries.append(f"\n  {json.dumps(name)}: {body}")
    parts.append(",".join(entries) + "\n }\n}\n")
    text = "".join(parts)
    json.loads(text)  # must be valid JSON
    return text


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write (or ``--check``) the bundled loads file."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source-dir", type=Path, default=DEFAULT_SOURCE_DIR, help="SGLang statistics directory")
    ap.add_argument("--output", type=Path, default=OUTPUT)
    ap.add_argument("--check", action="store_true", help="only verify that --output is up to date")
    args = ap.parse_args(argv)
    text = render(args.source_dir.resolve())
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else ""
        if current != text:
            print(f"{args.output} is out of date; run {Path(__file__).name}", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({len(text.encode()) / 1024:.0f} KiB, {len(PHASES)} phases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
