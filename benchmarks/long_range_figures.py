"""Figures of the long-range benchmark (:mod:`benchmarks.long_range`): learning curves and what
trained attention heads look at."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks.results_curves import mean_curve
from iresflow.nn.attention import ContractiveL2MultiheadAttention
from iresflow.nn.diagnostics import attention_weights
from iresflow.nn.positional import PositionalBranch
from iresflow.runs.load import load_run


def plot_curves(name: str, runs: list[dict[str, Any]], path: Path) -> Path:
    """Validation NLL against optimisation seconds (mean over seeds) of every model of one
    dataset, with the exact density (floor) and the AR(p) Gaussian as horizontal lines.

    Args:
        name: Dataset name (the title).
        runs: The per-seed results of :func:`benchmarks.long_range.run_seed`.
        path: Destination ``.png``.

    Returns:
        ``path``.
    """
    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    floor = sum(r["floor"] for r in runs) / len(runs)
    ar = sum(r["ar"] for r in runs) / len(runs)
    ax.axhline(floor, color="k", linestyle="--", linewidth=1, label="exact density (floor)")
    ax.axhline(ar, color="grey", linestyle=":", linewidth=1, label="AR(p) Gaussian")
    for index, model in enumerate(runs[0]["models"]):
        seconds, nll = mean_curve([[list(p) for p in r["models"][model]["history"]]
                                   for r in runs])
        if seconds:
            ax.plot(seconds, nll, marker=".", label=model, color=f"C{index % 10}")
    margin = max(ar - floor, 1e-3)
    ax.set_ylim(floor - 0.2 * margin, ar + 1.0 * margin)
    ax.set_xscale("log")
    ax.set_xlabel("optimisation seconds")
    ax.set_ylabel("validation NLL (nats/frame)")
    ax.set_title(f"{name}: mean over {len(runs)} seed(s)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_attention(run_dir: Path, path: Path,
                   periods: Callable[[str, torch.Tensor], torch.Tensor]) -> Path:
    """What the heads of a trained run's first L2 attention branch attend to, on one test
    sequence: the sequence (top) and each head's attention weights (query rows, key columns),
    with the diagonals one period (or a multiple) away marked.

    Args:
        run_dir: A run trained on a synthetic dataset, with at least one L2 attention branch.
        path: Destination ``.png``.
        periods: ``(dataset name, x (B, N, D)) -> (B,)`` period of every sequence.

    Returns:
        ``path``.
    """
    run = load_run(run_dir, device="cpu")
    model = run.model.double().eval()
    x, mask = run.dataset.test.x[:1].double(), run.dataset.test.mask[:1]
    period = int(periods(run.dataset.name, x)[0])
    sequence = x.clone()
    with torch.no_grad():
        for _, step in model.transform.named_steps():
            branch = getattr(step, "branch", None)
            if isinstance(branch, PositionalBranch) and isinstance(
                    branch.branch, ContractiveL2MultiheadAttention):
                weights = attention_weights(branch, x, mask)[0]  # (H, N, N)
                break
            x = step(x, mask=mask, logdet=False)[0]
        else:
            raise ValueError(f"{run_dir} has no L2 attention branch")
    heads, n = weights.shape[0], weights.shape[-1]
    figure = Figure(figsize=(3.2 * heads + 1, 6.2), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(2, heads, height_ratios=(1, 3))
    top = figure.add_subplot(grid[0, :])
    top.plot(sequence[0].numpy())
    top.set_title(f"a test sequence (period {period})", fontsize=9)
    top.set_xlim(0, n - 1)
    for h in range(heads):
        ax = figure.add_subplot(grid[1, h])
        ax.imshow(weights[h].numpy(), cmap="viridis", vmin=0)
        for k in range(-(n // period), n // period + 1):
            if k != 0:
                ax.plot([max(0, -k * period), min(n, n - k * period) - 1],
                        [max(0, k * period), min(n, n + k * period) - 1],
                        color="w", linewidth=0.5, linestyle=":")
        ax.set_title(f"head {h + 1}: weights (query row, key column)", fontsize=8)
        ax.set_xlabel("key frame")
        ax.set_ylabel("query frame")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
