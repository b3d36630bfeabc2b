"""Learning curves of the results table (:mod:`benchmarks.results`): the test NLL against
optimisation seconds, mean over seeds, one figure per dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.results_specs import SPECS


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


def write_learning_curves(report: dict[str, Any], folder: Path, stem: str) -> list[Path]:
    """One figure per dataset: test NLL against optimisation seconds, mean over seeds.

    Trained models are drawn as curves (log time axis), closed-form fits as horizontal lines.

    Returns:
        The paths of the PNG files written (``folder/<stem>_learning_curve_<dataset>.png``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, per_model in report["datasets"].items():
        figure = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        finals: list[float] = []
        for key, entry in per_model.items():
            summary = entry.get("summary", {})
            if entry["status"] != "ok" or "test_nll" not in summary:
                continue
            label, color = SPECS[key].label, f"C{list(SPECS).index(key) % 10}"
            if not SPECS[key].trained:
                ax.axhline(summary["test_nll"], linestyle="--", linewidth=1, label=label,
                           color=color)
                finals.append(summary["test_nll"])
                continue
            seconds, nll = mean_curve([r.get("curve", []) for r in entry["runs"]
                                       if "error" not in r])
            if seconds:
                ax.plot(seconds, nll, marker=".", label=label, color=color)
                finals.append(nll[-1])
        if finals:
            low, high = min(finals), max(finals)
            margin = max(high - low, 1e-3)
            ax.set_ylim(low - 0.3 * margin, high + 0.8 * margin)  # early epochs may be far off
        ax.set_xscale("log")
        ax.set_xlabel("optimisation seconds")
        ax.set_ylabel(f"test NLL ({report['dataset_info'][name]['unit']}; validation "
                      "estimator)")
        ax.set_title(f"{name}: mean over seeds ({report['meta']['mode']} mode)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = folder / f"{stem}_learning_curve_{name}.png"
        figure.savefig(path, dpi=110, bbox_inches="tight")
        paths.append(path)
    return paths
