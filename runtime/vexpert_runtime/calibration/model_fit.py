"""Model calibration (paper §3.2.2, App. B.4 step 1): fit Δ(L, V) = α·L + β·V + intercept.

For windows of ``k`` iterations of a load trace, the allocator is run with V = 1..Vmax vExperts
forced on every layer; the balance ratio before (base placement) and after (the plan) is
recorded on the *next* window's counts (``evaluate="next"``: the plan serves the future, as online)
or on the same window (``"same"``: in-sample, what the paper's offline tracing measures). A least
squares fit of Δ = L_after − L_before on (L_before, V) gives the model's coefficients, with R² and
residuals per layer. Δ(L, 0) = 0 by definition, so V = 0 contributes no rows.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vexpert_runtime import __version__
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.policy.allocator import AllocatorConfig, allocate
from vexpert_runtime.policy.placement import balance_ratio, base_gpu_loads, gpu_loads, static_placement
from vexpert_runtime.policy.profile import (
    COEFFICIENT_LIMIT,
    LoadBalanceParameters,
    PerformanceProfile,
    Provenance,
)


@dataclass(frozen=True)
class BalanceSamples:
    """Rows of the regression. All arrays [S]."""

    balance_before: np.ndarray
    vexperts: np.ndarray
    delta: np.ndarray
    layer: np.ndarray


@dataclass(frozen=True)
class BalanceFit:
    alpha: float
    beta: float
    intercept: float
    r2: float
    rmse: float
    samples: int
    residual_rms_per_layer: list[float]

    def parameters(self) -> LoadBalanceParameters:
        return LoadBalanceParameters(alpha=self.alpha, beta=self.beta, intercept=self.intercept)


def collect_balance_samples(
    counts: np.ndarray | torch.Tensor,
    num_gpus: int,
    vmax: int = 2,
    window: int = 10,
    evaluate: str = "next",
    max_windows: int | None = 24,
) -> BalanceSamples:
    """Run the allocator with V = 1..vmax on every layer of every window; record (L, V, Δ).

    Args: counts [T, L, E] per-iteration expert counts; window k iterations per allocation;
        max_windows: evenly spaced subset of windows to use (None = all).
    Returns one row per (window, layer, V).
    """
    c = torch.as_tensor(np.asarray(counts), dtype=torch.float32)
    if c.dim() != 3:
        raise VExpertInputError("--trace", f"counts must be [iterations, layers, experts], got shape {tuple(c.shape)}")
    if bool((c < 0).any()):
        raise VExpertInputError("--trace", "negative expert counts")
    iterations, num_layers, num_experts = c.shape
    if num_experts % num_gpus:
        raise VExpertInputError("--gpus", f"{num_experts} experts cannot be split evenly over {num_gpus} GPUs")
    if vmax < 1:
        raise VExpertInputError("--vmax", f"must be ≥ 1, got {vmax}")
    if window < 1:
        raise VExpertInputError("--k", f"must be ≥ 1, got {window}")
    if evaluate not in ("next", "same"):
        raise VExpertInputError("--evaluate", f"must be 'next' or 'same', got {evaluate!r}")
    needed = 2 * window if evaluate == "next" else window
    if iterations < needed:
        raise VExpertInputError("--trace", f"needs at least {needed} iterations for k={window}, got {iterations}")
    base = static_placement(num_layers, num_experts, num_gpus)
    starts = list(range(0, iterations - needed + 1, window))
    if max_windows and len(starts) > max_windows:  # evenly spaced over the whole trace
        picks = np.unique(np.linspace(0, len(starts) - 1, max_windows).round().astype(int))
        starts = [starts[i] for i in picks]
    rows_l, rows_v, rows_d, rows_layer = [], [], [], []
    for start in starts:
        plan_counts = c[start : start + window].sum(0)
        eval_counts = c[start + window : start + 2 * window].sum(0) if evaluate == "next" else plan_counts
        before = balance_ratio(base_gpu_loads(eval_counts, base, num_gpus))
        for v in range(1, vmax + 1):
            # Force V on every layer: no τ filter, no cost model (it is what we are calibrating), no
            # adjacency bound (with S = v it would halve every other layer).
            cfg = AllocatorConfig(group_size=1, vmax=v, balance_threshold=1.0, use_cost_model=False, adjacency_bound=False)
            plan = allocate(plan_counts, base, num_gpus, cfg)
            after = balance_ratio(gpu_loads(eval_counts, plan.expert_gpu_share()))
            rows_l.append(before.numpy())
            rows_v.append(np.full(num_layers, v, dtype=np.float64))
            rows_d.append((after - before).numpy())
            rows_layer.append(np.arange(num_layers))
    return BalanceSamples(
        balance_before=np.concatenate(rows_l).astype(np.float64),
        vexperts=np.concatenate(rows_v),
        delta=np.concatenate(rows_d).astype(np.float64),
        layer=np.concatenate(rows_layer),
    )


def fit_balance_model(samples: BalanceSamples) -> BalanceFit:
    """Least squares Δ ≈ α·L + β·V + intercept; R², RMSE and residual RMS per layer."""
    n = samples.delta.shape[0]
    if n < 3:
        raise VExpertInputError("--trace", f"only {n} samples; need at least 3 to fit three coefficients")
    design = np.stack([samples.balance_before, samples.vexperts, np.ones(n)], axis=1)
    if np.linalg.matrix_rank(design) < 3:
        raise VExpertInputError(
            "--trace", "the samples do not vary enough to fit α, β and the intercept",
            "use a trace with several layers or phases and --vmax ≥ 2",
        )
    coef, *_ = np.linalg.lstsq(design, samples.delta, rcond=None)
    if not np.isfinite(coef).all() or np.abs(coef).max() > COEFFICIENT_LIMIT:
        raise VExpertInputError(
            "--trace",
            f"the fit is ill-conditioned (α={coef[0]:.3g}, β={coef[1]:.3g}, intercept={coef[2]:.3g}; "
            f"|coefficient| must be ≤ {COEFFICIENT_LIMIT:g}): the balance ratio barely varies in this trace",
            "use a trace with skewed, drifting loads (several phases or layers) and --vmax ≥ 2",
        )
    pred = design @ coef
    resid = samples.delta - pred
    ss_res = float((resid**2).sum())
    ss_tot = float(((samples.delta - samples.delta.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    layers = int(samples.layer.max()) + 1 if n else 0
    per_layer = [
        float(np.sqrt((resid[samples.layer == i] ** 2).mean())) if (samples.layer == i).any() else 0.0
        for i in range(layers)
    ]
    return BalanceFit(
        alpha=float(coef[0]), beta=float(coef[1]), intercept=float(coef[2]), r2=r2,
        rmse=float(np.sqrt(ss_res / n)), samples=n, residual_rms_per_layer=per_layer,
    )


def calibrate_model(
    traces: list[np.ndarray], num_gpus: int, vmax: int = 2, window: int = 10, evaluate: str = "next",
    model: str = "", revision: str = "",
) -> tuple[PerformanceProfile, BalanceFit]:
    """Fit the load-balance coefficients on one or more traces; returns the profile and the fit."""
    started = time.perf_counter()
    parts = [collect_balance_samples(t, num_gpus, vmax, window, evaluate) for t in traces]
    samples = BalanceSamples(*(np.concatenate([getattr(p, f) for p in parts]) for f in BalanceSamples.__dataclass_fields__))
    fit = fit_balance_model(samples)
    profile = PerformanceProfile(
        load_balance=fit.parameters(),
        provenance=Provenance(
            source="model-calibration", tool_version=__version__, model=model, model_revision=revision,
            fit_r2=fit.r2,
            measurements={
                "samples": fit.samples, "rmse": round(fit.rmse, 5), "evaluate": evaluate, "k": window,
                "vmax": vmax, "gpus": num_gpus, "elapsed_s": round(time.perf_counter() - started, 2),
                "worst_layer_residual_rms": round(max(fit.residual_rms_per_layer), 5),
            },
        ),
    )
    return profile, fit


def termination_message(profile: PerformanceProfile, limit: int = 4096) -> str:
    """The profile as compact JSON within Kubernetes' termination-message limit (drops raw
    measurements first; the full result goes to --output)."""
    text = profile.model_dump_json()
    if len(text.encode()) <= limit:
        return text
    trimmed = profile.model_copy(update={"provenance": profile.provenance.model_copy(update={"measurements": {}})})
    return trimmed.model_dump_json()


STATISTICS_ITERATIONS = 200  # iterations sampled from an SGLang statistics file used as a trace


def _load_counts(source: str, gpus: int) -> np.ndarray:
    """A trace ``.npz``, or expert statistics (SGLang ``.json`` / ``bundled:NAME``) sampled into a
    200-iteration decode trace at 256 tokens per GPU, top-8, seed 0."""
    from vexpert_runtime.simulation.trace import Phase, build_trace, load_trace

    if source.endswith(".json") or source.startswith("bundled:"):
        return build_trace([Phase(source, STATISTICS_ITERATIONS)], gpus, 256, 8, seed=0).counts
    return load_trace(source).counts


def run_model_calibration(args: argparse.Namespace) -> int:
    """CLI handler of ``vexpert calibrate model``."""
    from vexpert_runtime.calibration.hardware import write_termination_message
    from vexpert_runtime.outputs import check_output_path

    if args.output:
        check_output_path(args.output, "--output")
    traces = [_load_counts(path, args.gpus) for path in args.trace]
    shapes = {t.shape[1:] for t in traces}
    if len(shapes) > 1:
        raise VExpertInputError("--trace", f"traces disagree on [layers, experts]: {sorted(shapes)}")
    profile, fit = calibrate_model(
        traces, args.gpus, args.vmax, args.k, args.evaluate,
        model=getattr(args, "model", "") or "", revision=getattr(args, "revision", "") or "",
    )
    # --output is a profile too (--profile reads it): the full fit goes into its measurements.
    details = {"alpha": fit.alpha, "beta": fit.beta, "intercept": fit.intercept, "r2": fit.r2, "rmse": fit.rmse,
               "samples": fit.samples, "residual_rms_per_layer": fit.residual_rms_per_layer}
    full = profile.model_copy(update={"provenance": profile.provenance.model_copy(
        update={"measurements": {**profile.provenance.measurements, "fit": details}})})
    if args.output:
        Path(args.output).write_text(full.to_json())
    write_termination_message(getattr(args, "termination_log", None), termination_message(profile))
    if args.json:
        print(profile.model_dump_json(indent=2))
    else:
        print(f"Δ(L, V) = {fit.alpha:+.3f}·L {fit.beta:+.3f}·V {fit.intercept:+.3f}   "
              f"R² = {fit.r2:.3f}, RMSE = {fit.rmse:.4f}, {fit.samples} samples "
              f"(paper: −0.75·L + 0.53·V + 0.10)")
    return 0
