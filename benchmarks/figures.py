"""Figures of the benchmarks: learning curves (mean over seeds) of the results table and of the
long-range benchmark, and what trained attention heads look at."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks.results_report import entries
from benchmarks.results_specs import SPECS
from iresflow.nn.attention import ContractiveL2MultiheadAttention
from iresflow.nn.diagnostics import attention_weights
from iresflow.nn.positional import PositionalBranch
from iresflow.runs.load import load_run


def mean_curve(curves: list[list[list[float]]], points: int = 40
               ) -> tuple[list[float], list[float]]:
    """Mean over seeds of learning curves ``[[seconds, nll], ...]``.

    The curves are interpolated linearly in log-seconds onto a log-spaced grid of ``points``
    times spanning the range every curve covers (a single curve is returned as it is).

    Args:
        curves: One curve per seed, each with increasing positive seconds.
        points: Grid size.

    Returns:
        ``(seconds, mean nll)``; empty lists when no curve has a point.

    Example:
        >>> mean_curve([[[1.0, 2.0], [100.0, 0.0]], [[1.0, 4.0], [100.0, 2.0]]], points=3)
        ([1.0, 10.0, 100.0], [3.0, 2.0, 1.0])
    """
    curves = [c for c in curves if c]
    if not curves:
        return [], []
    if len(curves) == 1:
        return [p[0] for p in curves[0]], [p[1] for p in curves[0]]
    lo, hi = max(c[0][0] for c in curves), min(c[-1][0] for c in curves)
    grid = np.geomspace(lo, hi, points) if hi > lo else np.array([lo])
    values = [np.interp(np.log(grid), np.log([p[0] for p in c]), [p[1] for p in c])
              for c in curves]
    return [float(g) for g in grid], [float(v) for v in np.mean(values, axis=0)]


def _curves_figure(path: Path, title: str, ylabel: str,
                   lines: list[tuple[str, float, dict[str, Any]]],
                   curves: list[tuple[str, str, list[list[float]]]],
                   ylim: tuple[float, float] | None) -> Path:
    """Horizontal ``lines`` (label, value, style) and learning ``curves`` (label, colour, one
    ``[[seconds, nll], ...]`` per seed, drawn as their :func:`mean_curve`) on a log time axis."""
    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    for label, value, style in lines:
        ax.axhline(value, linewidth=1, label=label, **style)
    for label, color, per_seed in curves:
        seconds, nll = mean_curve(per_seed)
        if seconds:
            ax.plot(seconds, nll, marker=".", label=label, color=color)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xscale("log")
    ax.set_xlabel("optimisation seconds")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    return path


def results_curves(content: dict[str, Any], folder: Path, stem: str) -> list[Path]:
    """One figure per dataset of the results table (:mod:`benchmarks.results_report`): test NLL
    against optimisation seconds, mean over seeds; closed-form fits as horizontal lines.

    Returns:
        The paths written, ``folder/<stem>_learning_curve_<dataset>.png``.
    """
    paths = []
    units = {r["dataset"]: r["unit"] for r in content["records"]}
    for name, per_model in entries(content["records"]).items():
        lines, curves, finals = [], [], []
        for key, entry in per_model.items():
            summary = entry.get("summary", {})
            if entry["status"] != "ok" or "test_nll" not in summary:
                continue
            label, color = SPECS[key].label, f"C{list(SPECS).index(key) % 10}"
            if not SPECS[key].trained:
                lines.append((label, summary["test_nll"], {"linestyle": "--", "color": color}))
                finals.append(summary["test_nll"])
                continue
            per_seed = [r.get("curve", []) for r in entry["runs"] if "error" not in r]
            curves.append((label, color, per_seed))
            finals += mean_curve(per_seed)[1][-1:]
        ylim = None
        if finals:  # early epochs may be far off
            margin = max(max(finals) - min(finals), 1e-3)
            ylim = (min(finals) - 0.3 * margin, max(finals) + 0.8 * margin)
        paths.append(_curves_figure(
            folder / f"{stem}_learning_curve_{name}.png",
            f"{name}: mean over seeds ({content['settings']['mode']} mode)",
            f"test NLL ({units[name]}; validation estimator)", lines, curves, ylim))
    return paths


def long_range_curves(name: str, runs: list[dict[str, Any]], models: list[str], path: Path
                      ) -> Path:
    """Validation NLL against optimisation seconds (mean over seeds) of every model of one
    long-range dataset, with the exact density (floor) and the AR(p) Gaussian as lines.

    Args:
        name: Dataset name (the title).
        runs: The records of the dataset (:func:`benchmarks.long_range.run_seed`), one a seed.
        models: The models to draw (fields of every record).
        path: Destination ``.png``.

    Returns:
        ``path``.
    """
    floor = sum(r["floor"] for r in runs) / len(runs)
    ar = sum(r["ar"] for r in runs) / len(runs)
    lines = [("exact density (floor)", floor, {"color": "k", "linestyle": "--"}),
             ("AR(p) Gaussian", ar, {"color": "grey", "linestyle": ":"})]
    curves = [(model, f"C{index % 10}", [[list(p) for p in r[model]["history"]] for r in runs])
              for index, model in enumerate(models)]
    margin = max(ar - floor, 1e-3)
    return _curves_figure(path, f"{name}: mean over {len(runs)} seed(s)",
                          "validation NLL (nats/frame)", lines, curves,
                          (floor - 0.2 * margin, ar + 1.0 * margin))


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
