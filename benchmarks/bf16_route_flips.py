"""Why a bf16 node at DeepSeek-V3 expert size verifies badly against the single-process reference
(max_rel_error 0.80 in both the graphed and the eager single-rank run of gpu_node_path.py): the node's
EP layer on the GPU vs the reference on the CPU, layer by layer on the same inputs. bf16 rounding grows
the error layer by layer until one token's top-2 flips, which moves that layer by ~0.8; fp32 stays at
1e-6. GPU host: ``python benchmarks/bf16_route_flips.py``.
"""
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from gpu_node_path import spec_for, write_model

from vexpert_runtime.model.checkpoint import CheckpointReader
from vexpert_runtime.model.ep_moe import DeviceRoutingTable, ExpertStacks, ep_moe_layer, static_table
from vexpert_runtime.model.moe_math import relative_error, rms_norm, shared_forward
from vexpert_runtime.model.reference import ModelWeights, reference_moe_layer
from vexpert_runtime.model.routing import route
from vexpert_runtime.simulation.workload import drifting_workload


def main() -> None:
    spec = spec_for(4, 4, 7168, 2048, False)
    checkpoint = write_model(Path(tempfile.mkdtemp()) / "m", spec)
    dev = torch.device("cuda", 0)
    workload = drifting_workload((("decode_in1000out1000", 40), ("prefill_in4096", 40)), 4, 4, tokens_per_worker=256, seed=1)
    for dtype in (torch.bfloat16, torch.float32):
        weights = ModelWeights.load(CheckpointReader(checkpoint, spec), dtype)
        x, bias = workload.inputs(50, 0, 7168, dtype), workload.logit_bias(50)
        h, hd = x, x.to(dev)
        for layer in range(4):
            layer_bias = None if bias is None else bias[layer]
            normed, normed_d = rms_norm(h), rms_norm(hd)
            ref, _ = reference_moe_layer(normed, weights, layer, layer_bias)
            router = weights.routers[layer]
            router_d = type(router)(router.weight.to(dev),
                                    None if router.correction_bias is None else router.correction_bias.to(dev))
            ids, topk = route(normed_d, router_d, spec, None if layer_bias is None else layer_bias.to(dev))
            ids_cpu, _ = route(normed, router, spec, layer_bias)
            shared = weights.shared[layer]
            slots = torch.zeros(2, weights.experts[layer].shape[1], dtype=dtype, device=dev)
            y, _ = ep_moe_layer(normed_d, ids, topk, DeviceRoutingTable.of(static_table(4, 4, 1, 2), dev), layer,
                                ExpertStacks(weights.experts[layer].to(dev), slots, 2048),
                                None if shared is None else shared_forward(normed_d, shared), 0, 1, None)
            flips = int((ids.cpu().sort(1).values != ids_cpu.sort(1).values).any(1).sum())
            print(dtype, layer, "layer rel err", relative_error(y.cpu().float(), ref.float()), "route flips", flips,
                  "|x|", float(normed.float().norm()), flush=True)
            h, hd = h + ref, hd + y
        print(dtype, "final rel", relative_error(hd.cpu().float(), h.float()))


if __name__ == "__main__":
    main()
