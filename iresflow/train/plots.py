"""Figures of a run, written as PNG files with matplotlib's Agg canvas.

The figures are built with the object-oriented API (:class:`matplotlib.figure.Figure` on a
:class:`~matplotlib.backends.backend_agg.FigureCanvasAgg`), so they neither need a display nor
touch pyplot's global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from torch import Tensor

from iresflow._validation import check_mask, check_sequence

__all__ = ["plot_learning_curves", "plot_marginals", "plot_traces"]

#: At most this many features get a panel (the first ones).
MAX_PANELS = 16
_REAL = "tab:blue"
_MODEL = "tab:orange"


def plot_learning_curves(
    history: Sequence[dict[str, float]], path: str | Path, *, unit: str = ""
) -> Path:
    """Plot training and validation NLL, and the learning rate, against the epoch.

    Args:
        history: One dict per epoch with keys ``epoch``, ``train_nll``, ``val_nll``, ``lr``
            and, when validation is estimated, ``val_nll_stderr`` (drawn as a 2-sigma band).
        path: Destination ``.png``.
        unit: Unit of the NLL for the axis label, e.g. ``"nats/frame"``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile, pathlib
        >>> rows = [{"epoch": 1, "train_nll": 2.0, "val_nll": 2.1, "lr": 1e-3},
        ...         {"epoch": 2, "train_nll": 1.5, "val_nll": 1.7, "lr": 1e-3}]
        >>> plot_learning_curves(rows, pathlib.Path(tempfile.mkdtemp()) / "c.png").exists()
        True
    """
    if not history:
        raise ValueError("history must contain at least one epoch")
    epochs = [row["epoch"] for row in history]
    figure = Figure(figsize=(9, 3.5))
    figure.subplots_adjust(left=0.08, right=0.98, bottom=0.14, top=0.9, wspace=0.3)
    FigureCanvasAgg(figure)
    nll_axes, lr_axes = figure.subplots(1, 2)
    nll_axes.plot(epochs, [row["train_nll"] for row in history], "o-", label="train", ms=3)
    val = [row["val_nll"] for row in history]
    nll_axes.plot(epochs, val, "o-", label="validation", ms=3)
    if all("val_nll_stderr" in row for row in history):
        spread = torch.tensor([2 * row["val_nll_stderr"] for row in history])
        centre = torch.tensor(val)
        nll_axes.fill_between(
            epochs, (centre - spread).tolist(), (centre + spread).tolist(),
            alpha=0.3, color="tab:orange", label="validation ± 2 s.e.",
        )
    nll_axes.set(xlabel="epoch", ylabel=f"NLL ({unit})" if unit else "NLL",
                 title="negative log-likelihood")
    nll_axes.legend()
    lr_axes.plot(epochs, [row["lr"] for row in history], "o-", ms=3, color="tab:green")
    lr_axes.set(xlabel="epoch", ylabel="learning rate", yscale="log", title="learning rate")
    for axes in (nll_axes, lr_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(figure, path)


def plot_traces(
    real: Tensor,
    real_mask: Tensor,
    sampled: Tensor,
    sampled_mask: Tensor,
    path: str | Path,
    *,
    max_sequences: int = 4,
) -> Path:
    """Draw real and sampled sequences as per-feature traces over time.

    One panel per feature (the first :data:`MAX_PANELS`); each shows up to ``max_sequences``
    real sequences in blue and as many sampled ones in orange, over their real frames only.

    Args:
        real: Real sequences ``(B, N, D)``.
        real_mask: Their padding mask ``(B, N)``, ``True`` for real frames.
        sampled: Model samples ``(B', N', D)``.
        sampled_mask: Their padding mask ``(B', N')``.
        path: Destination ``.png``.
        max_sequences: Sequences drawn from each set.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile, pathlib
        >>> x, m = torch.randn(3, 5, 2), torch.ones(3, 5, dtype=torch.bool)
        >>> plot_traces(x, m, x, m, pathlib.Path(tempfile.mkdtemp()) / "t.png").exists()
        True
    """
    real_rows = _frames(real, real_mask, "real")
    sampled_rows = _frames(sampled, sampled_mask, "sampled")
    _check_same_features(real, sampled)
    figure, axes = _panels(real.shape[-1], height=1.8)
    for feature, panel in enumerate(axes):
        for rows, color, label in ((real_rows, _REAL, "real"), (sampled_rows, _MODEL, "sampled")):
            for i, sequence in enumerate(rows[:max_sequences]):
                panel.plot(sequence[:, feature], color=color, lw=1, alpha=0.8,
                           label=label if i == 0 else None)
        panel.set_title(f"feature {feature}", fontsize=9)
    axes[0].legend(fontsize=8)
    figure.supxlabel("frame")
    return _save(figure, path)


def plot_marginals(
    real: Tensor,
    real_mask: Tensor,
    sampled: Tensor,
    sampled_mask: Tensor,
    path: str | Path,
    *,
    bins: int = 40,
) -> Path:
    """Compare per-feature marginal histograms of real and sampled frames.

    Args:
        real: Real sequences ``(B, N, D)``.
        real_mask: Their padding mask ``(B, N)``.
        sampled: Model samples ``(B', N', D)``.
        sampled_mask: Their padding mask ``(B', N')``.
        path: Destination ``.png``.
        bins: Histogram bins, shared by both sets (over the real data's range).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile, pathlib
        >>> x, m = torch.randn(3, 5, 2), torch.ones(3, 5, dtype=torch.bool)
        >>> plot_marginals(x, m, x, m, pathlib.Path(tempfile.mkdtemp()) / "m.png").exists()
        True
    """
    real_values = real[_checked_mask(real, real_mask, "real")].double().cpu()
    sampled_values = sampled[_checked_mask(sampled, sampled_mask, "sampled")].double().cpu()
    _check_same_features(real, sampled)
    figure, axes = _panels(real.shape[-1], height=2.0)
    for feature, panel in enumerate(axes):
        column = real_values[:, feature]
        low, high = float(column.min()), float(column.max())
        edges = torch.linspace(low, high if high > low else low + 1.0, bins + 1).tolist()
        # one filled polygon per histogram: far cheaper to draw than a bar per bin
        panel.hist(column.numpy(), bins=edges, density=True, histtype="stepfilled", alpha=0.5,
                   color=_REAL, label="real")
        panel.hist(sampled_values[:, feature].numpy(), bins=edges, density=True,
                   histtype="stepfilled", alpha=0.5, color=_MODEL, label="model")
        panel.set_title(f"feature {feature}", fontsize=9)
    axes[0].legend(fontsize=8)
    return _save(figure, path)


def _checked_mask(x: Tensor, mask: Tensor, name: str) -> Tensor:
    check_sequence(x, name, allow_2d=False)
    checked = check_mask(mask, x, f"{name}_mask")
    if checked is None:
        raise TypeError(f"{name}_mask must be a boolean tensor of shape (B, N), got None")
    return checked


def _check_same_features(real: Tensor, sampled: Tensor) -> None:
    if real.shape[-1] != sampled.shape[-1]:
        raise ValueError(
            f"real and sampled must have the same number of features, got {real.shape[-1]} "
            f"and {sampled.shape[-1]}"
        )


def _frames(x: Tensor, mask: Tensor, name: str) -> list[Tensor]:
    """Per-sequence ``(n_b, D)`` CPU tensors of the real frames."""
    checked = _checked_mask(x, mask, name)
    return [seq[keep].double().cpu() for seq, keep in zip(x, checked, strict=True)]


def _panels(features: int, height: float) -> tuple[Figure, list]:
    shown = min(features, MAX_PANELS)
    columns = min(shown, 4)
    rows = math.ceil(shown / columns)
    width, total_height = 3.2 * columns, height * rows + 0.9
    figure = Figure(figsize=(width, total_height))
    # fixed margins (in inches): a layout engine would measure every tick label of every panel
    figure.subplots_adjust(left=0.5 / width, right=1 - 0.1 / width, bottom=0.55 / total_height,
                           top=1 - 0.35 / total_height, wspace=0.25, hspace=0.45)
    FigureCanvasAgg(figure)
    grid = figure.subplots(rows, columns, squeeze=False)
    axes = [panel for row in grid for panel in row]
    for unused in axes[shown:]:
        unused.set_visible(False)
    if shown < features:
        figure.suptitle(f"first {shown} of {features} features", fontsize=9)
    return figure, axes[:shown]


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
