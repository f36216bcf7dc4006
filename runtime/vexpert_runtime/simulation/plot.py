"""Balance-over-iterations plot (the paper's Fig. 6a) for simulator results."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from vexpert_runtime.errors import VExpertInputError

if TYPE_CHECKING:
    from vexpert_runtime.simulation.simulate import PolicyResult


def plot_balance(results: dict[str, PolicyResult], phase_starts: list[int], phase_names: list[str], path: str | Path) -> None:
    """Write a PNG: per-iteration mean balance ratio (over layers) of every policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the install
        raise VExpertInputError("--plot", "matplotlib is not installed", "pip install 'vexpert[plot]'") from None
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    colors = [plt.get_cmap("tab20")(j) for j in range(20)]  # more rows than the default 10-colour cycle
    for i, (name, result) in enumerate(results.items()):
        series = result.balance.mean(axis=1)
        style = ":" if not result.scored else "-"  # a bound, not a policy
        ax.plot(series, style, color=colors[(2 * i) % 20 + (i // 10) % 2], label=f"{name} ({series.mean():.3f})", linewidth=1.2)
    for start, name in zip(phase_starts, phase_names, strict=False):
        ax.axvline(start, color="grey", linestyle=":", linewidth=0.8)
        ax.text(start + 2, 1.01, name, fontsize=7, color="grey", va="bottom")
    ax.set_xlabel("decode iteration")
    ax.set_ylabel("balance ratio (mean / max GPU load)")
    ax.set_ylim(0, 1.08)
    ax.legend(fontsize=7, ncol=3, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
