"""What one serving rank keeps of a model besides its routed experts, with ``--linear-format dense`` vs ``fp8_block``.

The model is built from its config on the meta device (no weights; transformers' defaults are DeepSeek-V3's 671B
release), and every non-expert tensor counted as the rank loads it: a linear the checkpoint stores as block FP8
(DeepSeek-V3's release stores every one but ``lm_head`` so; embeddings, norms and routers are bf16) stays FP8
where :func:`~vexpert_runtime.serve.fp8_linear.converts_to_fp8` says so (a byte per weight plus a float32 scale per
128 × 128 block), else bf16. Attention is replicated on every rank (no tensor parallelism), so this is per rank.

    PYTHONPATH=runtime python benchmarks/nonexpert_bytes.py            # DeepSeek-V3
    PYTHONPATH=runtime python benchmarks/nonexpert_bytes.py --config path/to/config.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vexpert_runtime.serve.fp8_linear import converts_to_fp8

BLOCK = (128, 128)


def rank_bytes(config: Any = None) -> dict[str, Any]:
    """The counts for ``config`` (a transformers config; default DeepSeek-V3's): FP8 linear parameters, bytes of
    their weights and scales, the bf16 bytes kept, and the per-rank totals under either linear format."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = config or DeepseekV3Config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    rows: dict[str, int] = {"fp8_linear_weights": 0, "fp8_linear_scales": 0, "bf16_kept": 0}
    fp8_params = 0
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    for name, tensor in model.named_parameters():
        if ".mlp.experts." in name:  # routed experts: the EP executor's rows, not counted here
            continue
        module_name = name.rpartition(".")[0]
        module = linears.get(module_name)
        stored_fp8 = module is not None and module_name != "lm_head" and name.endswith(".weight")
        if stored_fp8 and converts_to_fp8(module, module_name):
            rows["fp8_linear_weights"] += tensor.numel()
            rows["fp8_linear_scales"] += 4 * math.ceil(tensor.shape[0] / BLOCK[0]) * math.ceil(tensor.shape[1] / BLOCK[1])
            fp8_params += tensor.numel()
        else:
            rows["bf16_kept"] += 2 * tensor.numel()
    dense = rows["bf16_kept"] + 2 * fp8_params
    kept = rows["bf16_kept"] + rows["fp8_linear_weights"] + rows["fp8_linear_scales"]
    return {"model": type(model).__name__, "layers": config.num_hidden_layers, "fp8_linear_params": fp8_params, **rows,
            "per_rank_bytes_linear_format_dense": dense, "per_rank_bytes_linear_format_fp8_block": kept,
            "per_rank_gb_linear_format_dense": round(dense / 1e9, 2),
            "per_rank_gb_linear_format_fp8_block": round(kept / 1e9, 2), "saved_gb": round((dense - kept) / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="a config.json (default: transformers' DeepseekV3Config())")
    args = parser.parse_args()
    from transformers import AutoConfig

    print(json.dumps(rank_bytes(AutoConfig.from_pretrained(str(args.config.parent)) if args.config else None),
                     indent=1))


if __name__ == "__main__":
    main()
