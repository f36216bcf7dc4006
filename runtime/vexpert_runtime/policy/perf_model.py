"""vExpert's performance model (paper §3.2: Eq. 1–5 and 8) as small pure functions over tensors.

Every function takes balance ratios ``L`` and vExpert counts ``V`` as tensors of any matching
(broadcastable) shape, so the allocator evaluates all layers × all candidate V at once.
Times are seconds.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from vexpert_runtime.policy.profile import HardwareParameters, LoadBalanceParameters, PerformanceProfile

# DeepSeek-V3 routed expert in bf16: gate+up+down = 3 × 7168 × 2048 parameters × 2 bytes
# (the paper's 84 MiB slot per vExpert, Appendix D).
DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048 * 2


class InferenceConstants(BaseModel):
    """The allocator's "inference constant" C: what one decode step looks like.

    Defaults describe DeepSeek-V3 decode at 256 tokens per GPU on EP64. The three per-layer times
    are chosen so that the model reproduces the paper's figures: at the static balance ratio 0.43 a
    layer takes 2.0 + 1.8/0.43 ≈ 6.2 ms (61 layers ≈ 0.38 s per step ≈ 540 tokens/s per GPU, the
    paper's 542), and lifting balance to 0.76 with ~0.7 vExperts per layer gives ≈1.28× (paper:
    1.284×). Runtimes measure their own and override them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_gpu: int = Field(256, gt=0, description="Decode batch per GPU (B), tokens")
    reference_tokens_per_gpu: int = Field(
        256, gt=0, description="Batch B_ref at which the a2a and MoE times below are given; they scale with B / B_ref"
    )
    top_k: int = Field(8, gt=0, description="Routed experts per token")
    experts_per_gpu: int = Field(4, gt=0, description="Base (logical) experts per GPU, E / N")
    expert_bytes: int = Field(DEEPSEEK_V3_EXPERT_BYTES, gt=0, description="Bytes of one expert's weights (M_expert)")
    a2a_time_balanced_s: float = Field(1.0e-3, ge=0, description="Dispatch+combine time of one layer at L=1 and B_ref, s")
    moe_time_balanced_s: float = Field(0.8e-3, ge=0, description="Expert GEMM time of one layer at L=1 and B_ref, s")
    other_time_per_layer_s: float = Field(2.0e-3, ge=0, description="Attention and everything else per layer, s")
    eplb_stall_s: float = Field(1.0, ge=0, description="Stop-the-world time of one EPLB weight rearrangement, s")
    allocation_time_s: float | None = Field(
        None, ge=0,
        description="One vExpert allocation, s; None = from the profile: measured allocator time + the counts "
                    "all-reduce (the paper's App. F constant was 4 + 7 ms)",
    )
    # What the HBM holds besides the KV cache (issue #14). Defaults: DeepSeek-V3 in bf16 at EP64 with
    # data-parallel attention: 4 routed experts × 58 layers (20.4 GB) + 17.1 B replicated non-expert
    # parameters (34.2 GB), and 5 GB of activations, graphs and communication buffers.
    weight_bytes_per_gpu: float = Field(54.6e9, ge=0, description="Weights resident on every GPU without any slot or replica, bytes")
    reserved_bytes_per_gpu: float = Field(5.0e9, ge=0, description="Activations, CUDA graphs, NCCL buffers per GPU, bytes")
    kv_bytes_per_token: float = Field(
        70_272, gt=0, description="KV cache per token over all layers (DeepSeek-V3 MLA: (512 + 64) × 2 B × 61), bytes"
    )


def allreduce_time(payload_bytes: float, hw: HardwareParameters) -> float:
    """One all-reduce over the EP group: latency + payload / bus bandwidth, seconds."""
    return hw.allreduce_latency_s + payload_bytes / (hw.allreduce_bandwidth_gb_per_s * 1e9)


def allocation_time(consts: InferenceConstants, hw: HardwareParameters, num_layers: int, num_experts: int) -> float:
    """One allocation charged to decode: the count all-reduce ([L, E] fp32) + the allocator's
    mapping, both from the profile, unless the constants pin a value. Seconds."""
    if consts.allocation_time_s is not None:
        return consts.allocation_time_s
    return allreduce_time(4.0 * num_layers * num_experts, hw) + hw.allocator_time_s


def dispatch_time(mode: str, num_experts: int, hw: HardwareParameters) -> float:
    """Per layer and iteration cost of per-iteration replica dispatch, seconds: none for the plan's
    fixed shares; the dispatch kernel for rank-local counts; the kernel plus one all-reduce of the
    layer's E counts (fp32) before it for all-reduced counts."""
    if mode == "plan":
        return 0.0
    if mode == "local":
        return hw.dispatch_time_per_layer_s
    if mode == "allreduce":
        return hw.dispatch_time_per_layer_s + allreduce_time(4.0 * num_experts, hw)
    raise ValueError(f"unknown dispatch mode {mode!r}")


def kv_cache_bytes(extra_resident_bytes: torch.Tensor | float, consts: InferenceConstants, hw: HardwareParameters) -> torch.Tensor:
    """HBM left for the KV cache per GPU when a policy keeps ``extra_resident_bytes`` more expert
    weights resident than the static placement (negative: it evicts some), bytes, ≥ 0."""
    free = hw.hbm_gb * 1e9 - consts.weight_bytes_per_gpu - consts.reserved_bytes_per_gpu
    return (free - torch.as_tensor(extra_resident_bytes, dtype=torch.float64)).clamp(min=0.0)


def batch_for_hbm(extra_resident_bytes: float, consts: InferenceConstants, hw: HardwareParameters) -> float:
    """Decode batch per GPU a policy fits: the static placement's batch ``tokens_per_gpu`` fills
    its KV cache, and the batch scales with the KV cache left (same context length per request).
    HBM not modeled (``hbm_gb`` 0) or no KV room at all in the static case: ``tokens_per_gpu``."""
    static = float(kv_cache_bytes(0.0, consts, hw))
    if hw.hbm_gb <= 0 or static <= 0:
        return float(consts.tokens_per_gpu)
    return consts.tokens_per_gpu * float(kv_cache_bytes(extra_resident_bytes, consts, hw)) / static


def balance_gain(
    balance: torch.Tensor, vexperts: torch.Tensor, params: LoadBalanceParameters
) -> torch.Tensor:
    """Δ(L, V) = α·L + β·V + intercept (Eq. 4), clamped so that 0 ≤ Δ ≤ 1 − L and Δ(L, 0) = 0.

    Args: balance [...] in (0, 1]; vexperts [...] (broadcastable) vExperts per GPU. Returns [...].
    """
    balance = balance.to(torch.float32)
    v = vexperts.to(torch.float32)
    raw = params.alpha * balance + params.beta * v + params.intercept
    delta = torch.minimum(raw.clamp(min=0.0), 1.0 - balance)
    return torch.where(v > 0, delta, torch.zeros_like(delta))


def comm_gain(balance: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """γ1 = 1 − (B / (L+Δ)) / (B / L) = Δ / (L + Δ) (Eq. 3): all-to-all time saved. Shapes [...]."""
    return delta / (balance + delta).clamp(min=1e-9)


def tokens_per_expert(balance: torch.Tensor, consts: InferenceConstants) -> torch.Tensor:
    """Tokens per expert on the most loaded GPU: B·top_k / (experts_per_gpu · L). Shape [...]."""
    return consts.tokens_per_gpu * consts.top_k / (consts.experts_per_gpu * balance.clamp(min=1e-6))


def moe_time(balance: torch.Tensor, consts: InferenceConstants, hw: HardwareParameters) -> torch.Tensor:
    """Expert-GEMM time of the straggler GPU at balance L, two regimes (§3.2.2, Fig. 8b).

    Compute-bound (tokens per expert ≥ threshold): time ∝ tokens. Memory-bound (below it): time
    is the weight-streaming floor, flat in tokens, so balancing gains nothing (γ2 ≈ 0).
    """
    thr = hw.compute_bound_tokens_per_expert
    tpe = tokens_per_expert(balance, consts).clamp(min=thr)
    # moe_time_balanced_s is the time at L = 1 and the reference batch (§3.2: B_max = B / L)
    tpe_reference = max(consts.reference_tokens_per_gpu * consts.top_k / consts.experts_per_gpu, thr)
    return consts.moe_time_balanced_s * tpe / tpe_reference


def compute_gain(
    balance: torch.Tensor, delta: torch.Tensor, consts: InferenceConstants, hw: HardwareParameters
) -> torch.Tensor:
    """γ2 = 1 − T_moe(L+Δ) / T_moe(L): equals γ1 when compute-bound, 0 when memory-bound. [...]."""
    before = moe_time(balance, consts, hw)
    after = moe_time(balance + delta, consts, hw)
    return 1.0 - after / before


def a2a_time(balance: torch.Tensor, consts: InferenceConstants) -> torch.Tensor:
    """Dispatch + combine time of one layer, ∝ B_max = B / L (Eq. 1). Shape [...]."""
    batch = consts.tokens_per_gpu / consts.reference_tokens_per_gpu
    return consts.a2a_time_balanced_s * batch / balance.clamp(min=1e-6)


def h2d_time(vexperts: torch.Tensor, consts: InferenceConstants, hw: HardwareParameters) -> torch.Tensor:
    """T_H2D(V) = V · M_expert / BW_H2D, seconds. Shape [...]."""
    return vexperts.to(torch.float32) * consts.expert_bytes / (hw.h2d_bandwidth_gb_per_s * 1e9)


def streamed_copy_cost(
    copy_s: torch.Tensor, behind_s: torch.Tensor, waits: torch.Tensor, eta: float
) -> torch.Tensor:
    """Decode time a layer's streamed vExperts add (layer-ahead pipeline, Eq. 2 and 5).

    The copies run while the layer before computes (``behind_s``): the part that overlaps costs
    Eq. 2's penalty η·T_H2D, a part longer than that compute (Eq. 5's hiding constraint broken)
    is exposed in full. Copies that ``waits`` for the previous layer's slots to be free (their slots
    overlap) cannot start before that layer ends and cost their full time.

    Args: copy_s, behind_s [...] seconds; waits [...] bool. Returns [...] seconds.
    """
    overlapped = torch.where(waits, torch.zeros_like(copy_s), torch.minimum(copy_s, behind_s))
    return overlapped * eta + (copy_s - overlapped)


def layer_time(balance: torch.Tensor, consts: InferenceConstants, hw: HardwareParameters) -> torch.Tensor:
    """T_i(L) = T_a2a(L) + T_moe(L) (Eq. 1) for a measured balance ratio, no H2D. Shape [...]."""
    return a2a_time(balance, consts) + moe_time(balance, consts, hw)


def predicted_layer_time(
    balance: torch.Tensor, vexperts: torch.Tensor, profile: PerformanceProfile, consts: InferenceConstants
) -> torch.Tensor:
    """T*_i(L, V) (Eq. 2): baseline minus communication and computation gains plus H2D·η.

    Args: balance [...] current balance ratio; vexperts [...] candidate vExperts per GPU.
    Returns predicted per-layer time in seconds, shape of the broadcast.
    """
    hw = profile.hardware
    delta = balance_gain(balance, vexperts, profile.load_balance)
    t_a2a = a2a_time(balance, consts)
    t_moe = moe_time(balance, consts, hw)
    gain = t_a2a * comm_gain(balance, delta) + t_moe * compute_gain(balance, delta, consts, hw)
    return t_a2a + t_moe - gain + h2d_time(vexperts, consts, hw) * hw.contention_eta


def normalized_h2d_overhead(
    vexperts: torch.Tensor, layer_time_s: torch.Tensor, consts: InferenceConstants, hw: HardwareParameters
) -> torch.Tensor:
    """O = η · V·M_expert / (BW_H2D · T_layer) (Eq. 8): H2D penalty as a share of layer time."""
    return hw.contention_eta * h2d_time(vexperts, consts, hw) / layer_time_s.clamp(min=1e-12)


def max_vexperts_hidden(layer_time_s: float, consts: InferenceConstants, hw: HardwareParameters) -> int:
    """Largest V with T_H2D(V) ≤ T_layer (Eq. 5's constraint): copies hide behind one layer."""
    per_expert = consts.expert_bytes / (hw.h2d_bandwidth_gb_per_s * 1e9)
    return int(layer_time_s // per_expert)
