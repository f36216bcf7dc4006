"""How far the W8A8 grouped GEMM (FP8 activations × block-FP8 rows) is from exact arithmetic over the same FP8
numbers, per GEMM and launch configuration, at DeepSeek-V3's expert sizes on a GPU (issue #21: the W8A8 GPU test
saw 1.5 % between the kernel and its float32 twin at 256 tokens).

Each GEMM's inputs are the FP8 values and scales the kernel reads; the reference multiplies them in float64. The
torch float32 twin (what the test compares with) is measured against the same reference, so a twin that is itself
off (TF32) shows; and the whole SwiGLU against its exact twin, where a small difference in the intermediate is
amplified by its requantisation (an e4m3 rounding or a group's scale flips):

    PYTHONPATH=runtime python benchmarks/w8a8_accuracy.py --tokens 16 256
    PYTHONPATH=runtime python benchmarks/w8a8_accuracy.py --amplification --device cpu   # that amplification alone
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from vexpert_runtime.model.expert_format import dequantize_fp8_block, quantize_fp8_block
from vexpert_runtime.model.fp8_activations import dequantize_activation_groups, quantize_activation_groups
from vexpert_runtime.model.grouped_gemm_kernel import grouped_gemm, launch_config
from vexpert_runtime.model.grouped_moe import GROUP_ALIGN
from vexpert_runtime.model.moe_math import relative_error

CONFIGS = [(16, 64, 128, 4, 3, 0), (16, 64, 128, 4, 3, 4), (64, 64, 128, 8, 3, 0), (64, 128, 128, 8, 4, 0),
           (64, 64, 128, 4, 3, 1), (32, 64, 128, 4, 3, 0)]


def _groups(a: torch.Tensor, offs: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(e, s, t) for e, (s, t) in enumerate(itertools.pairwise([0, *offs.tolist()])) if t > s]


def _exact(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """float64 product of dequantised a [M, K] and w [E, N, K] per group (SwiGLU of the halves)."""
    width = w.shape[1] // 2 if swiglu else w.shape[1]
    out = torch.zeros(a.shape[0], width, dtype=torch.float64, device=a.device)
    for e, s, t in _groups(a, offs):
        h = a[s:t] @ w[e].T
        out[s:t] = torch.nn.functional.silu(h[:, :width]) * h[:, width:] if swiglu else h
    return out


def amplification(device: str, rows: int = 64) -> None:
    """How much W8A8's requantised intermediate amplifies a small relative error in the gate/up GEMM's output
    (the kind an FP8 tensor core's reduced-precision accumulation makes): one DeepSeek-V3 expert in float32, the
    exact intermediate against one perturbed by ``eps`` (relative, Gaussian), both rounded to bf16, requantised and
    multiplied by the down projection."""
    from vexpert_runtime.model.fp8_activations import fp8_activation_round_trip

    inter, hidden, block = 2048, 7168, (128, 128)
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.cat([dequantize_fp8_block(*quantize_fp8_block(torch.randn(inter, hidden, device=device, generator=gen)
                                                               * 0.02, block), block, torch.float32)
                     for _ in range(2)])
    w2 = dequantize_fp8_block(*quantize_fp8_block(torch.randn(hidden, inter, device=device, generator=gen) * 0.02,
                                                  block), block, torch.float32)
    x = torch.randn(rows, hidden, device=device, generator=gen).to(torch.bfloat16)
    h = fp8_activation_round_trip(x.float(), 128) @ w13.T

    def down(gate_up: torch.Tensor) -> torch.Tensor:
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(torch.bfloat16)
        return fp8_activation_round_trip(act.float(), 128) @ w2.T

    exact = down(h)
    for eps in (1e-5, 1e-4, 3e-4, 1e-3):
        noisy = h * (1 + eps * torch.randn(h.shape, device=device, generator=gen))
        print(json.dumps({"perturbation": eps, "output_relative_difference": round(relative_error(down(noisy), exact), 5)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs=2, default=[2048, 7168], help="intermediate, hidden")
    parser.add_argument("--device", default="cuda", help="cpu: with TRITON_INTERPRET=1, small --sizes (a dry run)")
    parser.add_argument("--amplification", action="store_true", help="only the amplification of a perturbed "
                        "intermediate (torch, any device: --device cpu)")
    args = parser.parse_args()
    if args.amplification:
        amplification(args.device)
        return
    (inter, hidden), block, device = args.sizes, (128, 128), args.device
    gen = torch.Generator(device=device).manual_seed(0)
    w13q, s13, w2q, s2 = [], [], [], []
    for _ in range(args.experts):
        gate, up = (torch.randn(inter, hidden, device=device, generator=gen) * 0.02 for _ in range(2))
        down = torch.randn(hidden, inter, device=device, generator=gen) * 0.02
        (gq, gs), (uq, us), (dq, ds) = (quantize_fp8_block(w, block) for w in (gate, up, down))
        w13q.append(torch.cat([gq, uq]))
        s13.append(torch.cat([gs, us]))
        w2q.append(dq)
        s2.append(ds)
    w13, sc13, w2, sc2 = (torch.stack(t) for t in (w13q, s13, w2q, s2))
    w13_64 = torch.stack([torch.cat([dequantize_fp8_block(w13[e, :inter], sc13[e, :inter // 128], block, torch.float64),
                                     dequantize_fp8_block(w13[e, inter:], sc13[e, inter // 128:], block, torch.float64)])
                          for e in range(args.experts)])
    w2_64 = dequantize_fp8_block(w2, sc2, block, torch.float64)
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else device, "torch": torch.__version__,
                      "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                      "float32_matmul_precision": torch.get_float32_matmul_precision()}))
    for tokens in args.tokens:
        counts = torch.multinomial(torch.tensor([8.0, 4, 2, 1, 1, 0.5, 0.5, 0.01][:args.experts]), 2 * tokens,
                                   replacement=True, generator=torch.Generator().manual_seed(tokens)
                                   ).bincount(minlength=args.experts)
        offs = ((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN).cumsum(0).to(torch.int32).to(device)
        used = int(offs[-1])
        x = torch.randn(used, hidden, device=device, dtype=torch.bfloat16)
        xq, xs = quantize_activation_groups(x, 128)
        x64 = dequantize_activation_groups(xq, xs, 128, torch.float64)
        act64 = _exact(x64, w13_64, offs, swiglu=True)
        twin_act = _exact(x64.float(), w13_64.float(), offs, swiglu=True)
        rows = {"tokens": tokens, "rows": used, "table": [launch_config("gate_up", used / args.experts, True, True),
                                                          launch_config("down", used / args.experts, True, True)],
                "twin_float32_gate_up_vs_exact": relative_error(twin_act, act64)}
        for config in CONFIGS:
            act = grouped_gemm(xq, w13, offs, swiglu=True, config=config, scales=sc13, scale_block=block,
                               x_scales=xs, out_dtype=torch.bfloat16)
            aq, as_ = quantize_activation_groups(act, 128)
            a64 = dequantize_activation_groups(aq, as_, 128, torch.float64)
            out = grouped_gemm(aq, w2, offs, config=config, scales=sc2, scale_block=block, x_scales=as_,
                               out_dtype=torch.bfloat16)
            down64 = _exact(a64, w2_64, offs, swiglu=False)
            # the whole SwiGLU against its exact twin, whose intermediate is the exact one rounded to bf16 and
            # quantised: where the two intermediates differ by a bf16 step, an e4m3 rounding (or a group's scale) may
            # flip, so this is the GEMMs' error amplified by the second quantisation
            tq, ts = quantize_activation_groups(act64.to(torch.bfloat16), 128)
            twin64 = _exact(dequantize_activation_groups(tq, ts, 128, torch.float64), w2_64, offs, swiglu=False)
            per_row = ((out.double() - down64).norm(dim=1) / down64.norm(dim=1).clamp(min=1e-30))
            rows[str(config)] = {
                "gate_up_vs_exact": round(relative_error(act.double(), act64), 6),
                "bf16_of_exact_gate_up": round(relative_error(act64.to(torch.bfloat16).double(), act64), 6),
                "down_vs_exact_same_inputs": round(relative_error(out.double(), down64), 6),
                "down_rows_worst": round(float(per_row.max()), 6),
                "down_rows_over_1pct": int((per_row > 0.01).sum()),
                "intermediate_bf16_steps_off": round(float((act != act64.to(torch.bfloat16)).float().mean()), 6),
                "swiglu_vs_exact_twin": round(relative_error(out.double(), twin64), 6)}
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
