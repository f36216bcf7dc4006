"""The Triton attention kernels compile for an H200 (sm_90) on a machine without a GPU.

Triton's interpreter (test_attention_kernels.py) runs a kernel's Python, and accepts constructs the
compiler does not; ``benchmarks/kernel_resources.py`` compiles every launch configuration ``vexpert
serve`` uses with Triton's own compiler and ``ptxas`` (both ship in the Triton wheel) and reads the
registers, spills and shared memory from the cubin. Here: every kernel (attention, split-KV merge, the
expert GEMMs over bf16 and block-FP8 rows (W8A16 and W8A8), the routers' expert selection) compiles, fits an SM, and the merge (plain fp32 streaming) does not spill.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_attention_kernels_compile_for_sm90_and_fit_an_sm(tmp_path: Path) -> None:
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build ships no ptxas")
    out = tmp_path / "resources.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_resources.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["kernel"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert {"mla_decode rows>=128", "mla_decode rows<128", "mla_decode_split rows<128", "gqa_decode",
            "gqa_decode_split", "gqa_decode window", "merge_splits mla", "merge_splits gqa"} <= set(rows)
    assert sum(name.startswith("grouped_gemm") for name in rows) == 12
    assert sum(name.startswith("grouped_gemm fp8") for name in rows) == 8  # block-FP8 rows, read in place
    assert sum(name.startswith("grouped_gemm fp8 w8a8") for name in rows) == 4  # against FP8 activations: FP8 dots
    assert {"deepseek_v3_select 256 experts", "deepseek_v3_select 8 experts", "softmax_topk_select 128 experts"} <= set(rows)
    for name, row in rows.items():
        assert row["sass_instructions"] > 100, name
        assert row["programs_per_sm_by_registers"] >= 1 and row["programs_per_sm_by_shared"] >= 1, row
    assert rows["merge_splits mla"]["spill_bytes"] == 0 and rows["merge_splits gqa"]["spill_bytes"] == 0
