"""How skewed the embedded demo model's routing is (``vexpert serve`` without a model): per MoE layer,
the balance ratio (mean/max tokens per rank) of its routers on the demo tokenizer's own text, with
2 and 4 EP ranks, for router-skew strengths of :func:`~vexpert_runtime.serve.demo_model.real_load_bias`
(0 = random routers only; the shipped default is ``REAL_LOAD_STRENGTH``). CPU, ~10 s per strength.

    python benchmarks/demo_model_balance.py 0 0.05 0.15 0.3 > benchmarks/results/demo_model_balance.txt
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from vexpert_runtime.serve import demo_model


def balances(strength: float) -> list[tuple[float, float]]:
    """(EP2, EP4) balance per MoE layer of a demo model built with router-skew ``strength``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = demo_model.real_load_bias
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(
        demo_model, "real_load_bias", lambda layers, experts: original(layers, experts, strength=strength)
    ):
        path = demo_model.ensure_demo_model(Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        experts = model.config.n_routed_experts
        counts: list[torch.Tensor] = []

        def record(_module: object, _args: object, out: object) -> None:
            ids = next(t for t in (out if isinstance(out, tuple) else (out,)) if t.dtype == torch.int64)
            counts.append(torch.bincount(ids.reshape(-1), minlength=experts))

        for layer in model.model.layers[model.config.first_k_dense_replace:]:
            layer.mlp.gate.register_forward_hook(record)
        ids = tokenizer(demo_model._TEXT * 3, return_tensors="pt").input_ids[:, :1024]
        with torch.no_grad():
            model(ids)
    out = []
    for c in counts:
        per2, per4 = c.view(2, -1).sum(1).float(), c.view(4, -1).sum(1).float()
        out.append((float(per2.mean() / per2.max()), float(per4.mean() / per4.max())))
    return out


def main(argv: list[str]) -> int:
    print(f"# demo model router skew: default strength {demo_model.REAL_LOAD_STRENGTH}, "
          f"phase {demo_model.REAL_LOAD_PHASE}")
    for strength in map(float, argv or ["0", str(demo_model.REAL_LOAD_STRENGTH)]):
        for layer, (ep2, ep4) in enumerate(balances(strength)):
            print(f"strength {strength:<5} MoE layer {layer}: EP2 balance {ep2:.3f}  EP4 balance {ep4:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
