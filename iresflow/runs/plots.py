"""Figures of a run, written as PNG files with matplotlib's Agg canvas.

The figures are built with the object-oriented API (:class:`matplotlib.figure.Figure` on a
:class:`~matplotlib.backends.backend_agg.FigureCanvasAgg`), so they neither need a display nor
touch pyplot's global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from torch import Tensor

from iresflow._validation import check_mask, check_sequence
from iresflow.runs.scoring import INTERVALS, QUANTILES

__all__ = [
    "PlotLabels", "plot_fan", "plot_frame_scores", "plot_learning_curves", "plot_marginals",
    "plot_traces",
]

#: At most this many features get a panel (the first ones).
MAX_PANELS = 16
_REAL = "tab:blue"
_MODEL = "tab:orange"


@dataclass(frozen=True)
class PlotLabels:
    """What the axes of the sample figures show.

    Attributes:
        time: Name of the sequence axis, e.g. ``"frame"`` or ``"week"``.
        value: Quantity and unit of the values, e.g. ``"difference (ppm/week)"``.
        feature: Name of one feature, ``{index}`` standing for its index (from 1), e.g.
            ``"LPC cepstrum coefficient {index}"``.
        data: Name of the data for the titles.

    Example:
        >>> PlotLabels.for_dataset("co2_windows").value
        'CO2 change (ppm/week)'
        >>> PlotLabels.for_dataset("mine.npz").feature.format(index=2)
        'feature 2'
    """

    time: str = "frame"
    value: str = "value (original units)"
    feature: str = "feature {index}"
    data: str = "data"

    @classmethod
    def for_dataset(cls, name: str) -> PlotLabels:
        """The labels of a shipped dataset, or generic ones for a user file called ``name``."""
        return _DATASET_LABELS.get(name, cls(data=name))


_DATASET_LABELS = {
    "japanese_vowels": PlotLabels(
        time="frame (analysis window)", value="coefficient value",
        feature="LPC cepstrum coefficient {index}", data="JapaneseVowels",
    ),
    "digits_rows": PlotLabels(
        time="image row", value="pixel intensity (0-17, dequantised)",
        feature="pixel column {index}", data="digits (rows as frames)",
    ),
    "co2_windows": PlotLabels(
        time="week", value="CO2 change (ppm/week)", feature="weekly CO2 difference",
        data="Mauna Loa CO2 (52-week windows)",
    ),
}


def plot_learning_curves(
    history: Sequence[dict[str, float]],
    path: str | Path,
    *,
    unit: str = "",
    best_epoch: int | None = None,
) -> Path:
    """Plot training and validation NLL, and the learning rate, against the epoch.

    Args:
        history: One dict per epoch with keys ``epoch``, ``train_nll``, ``val_nll``, ``lr``
            and, when validation is estimated, ``val_nll_stderr`` (drawn as a 2-sigma band).
        path: Destination ``.png``.
        unit: Unit of the NLL for the axis label, e.g. ``"nats/frame"``.
        best_epoch: Epoch of the kept (best) checkpoint, marked in both panels.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile, pathlib
        >>> rows = [{"epoch": 1, "train_nll": 2.0, "val_nll": 2.1, "lr": 1e-3},
        ...         {"epoch": 2, "train_nll": 1.5, "val_nll": 1.7, "lr": 1e-3}]
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "c.png"
        >>> plot_learning_curves(rows, path, best_epoch=2).exists()
        True
    """
    if not history:
        raise ValueError("history must contain at least one epoch")
    epochs = [row["epoch"] for row in history]
    if best_epoch is not None and best_epoch not in epochs:
        raise ValueError(f"best_epoch {best_epoch} is not an epoch of the history")
    # constrained layout: it measures the tick labels, so no label overlaps them
    figure = Figure(figsize=(9, 3.5), layout="constrained")
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
    lr_axes.plot(epochs, [row["lr"] for row in history], "o-", ms=3, color="tab:green")
    if best_epoch is not None:
        for axes in (nll_axes, lr_axes):
            axes.axvline(best_epoch, color="0.4", ls="--", lw=1,
                         label=f"best (epoch {best_epoch})" if axes is nll_axes else None)
        nll_axes.plot([best_epoch], [val[epochs.index(best_epoch)]], "*", ms=11,
                      color="tab:red", zorder=3)
    nll_axes.set(xlabel="epoch", ylabel=f"NLL ({unit})" if unit else "NLL",
                 title=f"negative log-likelihood, {len(epochs)} epochs")
    nll_axes.legend(fontsize=8)
    lr_axes.set(xlabel="epoch", ylabel="learning rate", title="learning rate (end of epoch)")
    lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))  # one power of ten on top
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
    max_sequences: int | None = None,
    labels: PlotLabels | None = None,
) -> Path:
    """Draw real and sampled sequences as per-feature traces over time.

    One panel per feature (the first :data:`MAX_PANELS`); each shows the sampled sequences in
    orange and as many real sequences (the first ones) in blue, at their real frames (missing
    frames are gaps). The title states how many of each are drawn.

    Args:
        real: Real sequences ``(B, N, D)``.
        real_mask: Their padding mask ``(B, N)``, ``True`` for real frames.
        sampled: Model samples ``(B', N', D)``.
        sampled_mask: Their padding mask ``(B', N')``.
        path: Destination ``.png``.
        max_sequences: Sequences drawn from each set (default: all samples).
        labels: Axis names and units (default: generic).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile, pathlib
        >>> x, m = torch.randn(3, 5, 2), torch.ones(3, 5, dtype=torch.bool)
        >>> plot_traces(x, m, x, m, pathlib.Path(tempfile.mkdtemp()) / "t.png").exists()
        True
    """
    real_mask = _checked_mask(real, real_mask, "real")
    sampled_mask = _checked_mask(sampled, sampled_mask, "sampled")
    _check_same_features(real, sampled)
    if max_sequences is not None and max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    labels = labels if labels is not None else PlotLabels()
    count = len(sampled) if max_sequences is None else min(max_sequences, len(sampled))
    sets = (
        (real[:count], real_mask[:count], _REAL, "real"),
        (sampled[:count], sampled_mask[:count], _MODEL, "sampled"),
    )
    figure, axes = _panels(real.shape[-1], height=1.8)
    for feature, panel in enumerate(axes):
        for x, mask, color, name in sets:
            values = torch.where(mask, x[..., feature], torch.nan).double().cpu()
            alpha = min(0.8, max(0.25, 4.0 / len(values)))  # many lines: lighter ones
            for i, sequence in enumerate(values):
                panel.plot(sequence, color=color, lw=0.8, alpha=alpha,
                           label=name if i == 0 else None)
        panel.set_title(_feature_title(labels, feature, real.shape[-1]), fontsize=9)
    axes[0].legend(fontsize=8)
    figure.supxlabel(labels.time, fontsize=9)
    figure.supylabel(labels.value, fontsize=9)
    shown = min(count, len(real))
    figure.suptitle(
        f"{labels.data}: {count} model samples and {shown} real test sequences"
        + _panel_note(real.shape[-1]), fontsize=10,
    )
    return _save(figure, path)


def plot_marginals(
    real: Tensor,
    real_mask: Tensor,
    sampled: Tensor,
    sampled_mask: Tensor,
    path: str | Path,
    *,
    bins: int = 40,
    labels: PlotLabels | None = None,
) -> Path:
    """Compare per-feature marginal histograms of real and sampled frames.

    Args:
        real: Real sequences ``(B, N, D)``.
        real_mask: Their padding mask ``(B, N)``.
        sampled: Model samples ``(B', N', D)``.
        sampled_mask: Their padding mask ``(B', N')``.
        path: Destination ``.png``.
        bins: Histogram bins, shared by both sets (over the real data's range).
        labels: Axis names and units (default: generic).

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
    labels = labels if labels is not None else PlotLabels()
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
        panel.set_title(_feature_title(labels, feature, real.shape[-1]), fontsize=9)
    axes[0].legend(fontsize=8)
    figure.supxlabel(labels.value, fontsize=9)
    figure.supylabel("density", fontsize=9)
    figure.suptitle(
        f"{labels.data}: marginals of {len(real_values)} real test frames and "
        f"{len(sampled_values)} sampled frames" + _panel_note(real.shape[-1]), fontsize=10,
    )
    return _save(figure, path)


def plot_fan(
    observed: Tensor,
    mask: Tensor,
    samples: Tensor,
    start: int,
    path: str | Path,
    *,
    truth: Tensor | None = None,
    truth_mask: Tensor | None = None,
    labels: PlotLabels | None = None,
) -> Path:
    """A fan chart per feature: one sequence's observed frames, the median of the forecast
    draws and their central bands (:data:`~iresflow.runs.scoring.INTERVALS`: 50% and 90%), and
    the frames that followed, when known.

    Args:
        observed: The sequence ``(N, D)``.
        mask: Its observed frames ``(N,)``.
        samples: Forecast draws ``(S, H, D)`` of the frames from position ``start`` on.
        start: Position of the first forecast frame.
        path: Destination ``.png``.
        truth: The frames that followed ``(H, D)``, if known.
        truth_mask: Which of them are real ``(H,)``.
        labels: Axis names and units (default: generic).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile, pathlib
        >>> past, draws = torch.randn(6, 2), torch.randn(50, 3, 2)
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "fan.png"
        >>> plot_fan(past, torch.ones(6, dtype=torch.bool), draws, 6, path).exists()
        True
    """
    mask = _checked_mask(observed[None], mask[None], "observed")[0]
    check_sequence(samples, "samples", allow_2d=False)
    _check_same_features(observed[None], samples)
    labels = labels if labels is not None else PlotLabels()
    steps = range(start, start + samples.shape[1])
    levels = torch.tensor(QUANTILES, dtype=torch.float64)
    bands = torch.quantile(samples.double().cpu(), levels, dim=0).numpy()  # (Q, H, D)
    median, outer = QUANTILES.index(0.5), len(QUANTILES) - 1
    figure, axes = _panels(observed.shape[-1], height=2.0)
    for feature, panel in enumerate(axes):
        panel.plot(torch.where(mask, observed[:, feature], torch.nan).double().cpu(),
                   color=_REAL, lw=1.0, label="observed")
        for k, level in enumerate(sorted(INTERVALS, reverse=True)):  # widest first
            panel.fill_between(steps, bands[k, :, feature], bands[outer - k, :, feature],
                               color=_MODEL, alpha=0.2 * (k + 1), lw=0,
                               label=f"{level:.0%} interval")
        panel.plot(steps, bands[median, :, feature], color=_MODEL, lw=1.2, label="median")
        if truth is not None:
            real = torch.ones(len(steps), dtype=torch.bool) if truth_mask is None else truth_mask
            panel.plot(steps, torch.where(real, truth[:, feature], torch.nan).double().cpu()
                       .numpy(), color="black", lw=1.0, ls="--", label="what followed")
        panel.set_title(_feature_title(labels, feature, observed.shape[-1]), fontsize=9)
    axes[0].legend(fontsize=7)
    figure.supxlabel(labels.time, fontsize=9)
    figure.supylabel(labels.value, fontsize=9)
    figure.suptitle(f"{labels.data}: forecast of {samples.shape[1]} frames from "
                    f"{samples.shape[0]} draws" + _panel_note(observed.shape[-1]), fontsize=10)
    return _save(figure, path)


def plot_frame_scores(
    x: Tensor,
    mask: Tensor,
    nll: Tensor,
    path: str | Path,
    *,
    labels: PlotLabels | None = None,
    title: str = "",
    unit: str = "nats/frame",
) -> Path:
    """One sequence's frames above the NLL of every frame given the earlier ones.

    Args:
        x: The sequence ``(N, D)`` (its features share the upper axes, at most
            :data:`MAX_PANELS` of them).
        mask: Its real frames ``(N,)``.
        nll: The frame scores ``(N,)`` (``nan`` where there is none).
        path: Destination ``.png``.
        labels: Axis names and units (default: generic).
        title: What the sequence is, for the title.
        unit: The unit of ``nll``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile, pathlib
        >>> x, m = torch.randn(8, 3), torch.ones(8, dtype=torch.bool)
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "scores.png"
        >>> plot_frame_scores(x, m, torch.randn(8), path).exists()
        True
    """
    mask = _checked_mask(x[None], mask[None], "x")[0]
    if not isinstance(nll, Tensor) or nll.shape != mask.shape:
        raise ValueError(f"nll must be a tensor of shape (N,) = {tuple(mask.shape)}")
    labels = labels if labels is not None else PlotLabels()
    figure = Figure(figsize=(8.0, 5.0))
    FigureCanvasAgg(figure)
    data, scores = figure.subplots(2, 1, sharex=True)
    for feature in range(min(x.shape[-1], MAX_PANELS)):
        data.plot(torch.where(mask, x[:, feature], torch.nan).double().cpu(), lw=0.9)
    data.set_ylabel(labels.value, fontsize=9)
    data.set_title(f"{labels.data}: {title}".rstrip(": ") + _panel_note(x.shape[-1]),
                   fontsize=10)
    scores.bar(range(len(nll)), torch.where(mask, nll, torch.nan).double().cpu().numpy(),
               color=_MODEL)
    scores.set_ylabel(f"-log p(frame | earlier)\n({unit})", fontsize=9)
    scores.set_xlabel(labels.time, fontsize=9)
    scores.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(figure, path)


def _feature_title(labels: PlotLabels, feature: int, features: int) -> str:
    if features == 1 and "{index}" not in labels.feature:
        return labels.feature
    return labels.feature.format(index=feature + 1)


def _panel_note(features: int) -> str:
    return f" (first {MAX_PANELS} of {features} features)" if features > MAX_PANELS else ""


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


def _panels(features: int, height: float) -> tuple[Figure, list]:
    shown = min(features, MAX_PANELS)
    columns = min(shown, 4)
    rows = math.ceil(shown / columns)
    width, total_height = max(3.2 * columns, 7.0), height * rows + 1.3
    figure = Figure(figsize=(width, total_height))
    # fixed margins (in inches): a layout engine would measure every tick label of every panel
    figure.subplots_adjust(left=0.9 / width, right=1 - 0.15 / width, bottom=0.65 / total_height,
                           top=1 - 0.65 / total_height, wspace=0.3, hspace=0.5)
    FigureCanvasAgg(figure)
    grid = figure.subplots(rows, columns, squeeze=False)
    axes = [panel for row in grid for panel in row]
    for unused in axes[shown:]:
        unused.set_visible(False)
    return figure, axes[:shown]


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
