r"""Quantised features of users' data, found on their grid and dequantised
(docs/datasets.md#quantised).

Readings recorded on a grid (a sensor's counts, values rounded to a resolution, integer counts)
repeat exactly. A continuous density can pile its mass onto the repeated values: its
log-likelihood on such data grows without bound as it sharpens, and a trained flow's NLL then
measures how well it predicts the repeats, not the law of the process. The standard remedy is
uniform dequantisation: every value :math:`v` on a grid of step :math:`s` becomes
:math:`v + s\,(u - 1/2)` with :math:`u \sim \mathcal U[0, 1)`. A density of the result,
integrated over the bin of width :math:`s` around a value, is a lower bound on that value's
probability, so the density's NLL is a proper score of the discrete data (up to the constant
:math:`\log s` per dimension).

:func:`grid_step` finds the grid of one feature; :func:`dequantize_features` applies it to the
features of a user file that have one (``dequantize = "auto"``, the default of
:func:`~iresflow.data.datasets.load_dataset`).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from iresflow.data.preprocessing import uniform_dequantize

__all__ = ["DEQUANTIZE_CHOICES", "GRID_TOLERANCE", "MAX_LEVEL_FRACTION", "dequantize_features",
           "grid_step", "repeats"]

#: The values of ``dequantize``: ``auto`` dequantises the features found on a grid, ``off``
#: keeps the values as read.
DEQUANTIZE_CHOICES = ("auto", "off")
#: A feature is quantised when it takes at most this fraction as many distinct values as it has
#: observed values (every level recurs ten times on average or more) ...
MAX_LEVEL_FRACTION = 0.1
#: ... and every distinct value lies within this fraction of a step of one regular grid (values
#: on a grid and then rounded to a few decimals are still on it).
GRID_TOLERANCE = 0.02


def grid_step(values: Tensor, copies: int = 1) -> float | None:
    r"""The step of the regular grid that quantised values lie on, or ``None``.

    The values are quantised when they :func:`repeat <repeats>` (at most
    :data:`MAX_LEVEL_FRACTION` times as many distinct values, or levels, as frames hold them;
    overlapping windows of a series hold up to ``copies`` copies of a frame) and the levels
    :math:`l_0 < l_1 < \dots` lie on a grid :math:`l_0 + k s` within :data:`GRID_TOLERANCE` of
    :math:`s`. The step is fitted to all gaps between consecutive levels (each a whole number of
    steps, starting from the smallest gap, refined once), so values on a grid rounded to a few
    decimals keep their exact grid's step.

    Args:
        values: Observed values of one feature, any shape, finite, floating point.
        copies: How many of the values can be copies of one frame's.

    Returns:
        The step :math:`s > 0`, or ``None`` if the values are not quantised.

    Example:
        >>> grid_step(torch.tensor([0.0, 1.0, 1.0, 3.0] * 10))
        1.0
        >>> grid_step(torch.linspace(0.0, 1.0, 50)) is None  # no value repeats
        True
    """
    levels = values.detach().to(torch.float64).unique()  # sorted
    if len(levels) < 2 or not repeats(values, copies):
        return None
    gaps = levels.diff()
    step = gaps.min()
    for _ in range(2):  # whole steps per gap, then the step that fits them all
        multiples = (gaps / step).round()
        step = gaps.sum() / multiples.sum()
    grid = torch.cat([multiples.new_zeros(1), multiples.cumsum(0)])
    off_grid = ((levels - levels[0]) / step - grid).abs().amax()
    return float(step) if bool(off_grid <= GRID_TOLERANCE) else None


def repeats(values: Tensor, copies: int = 1) -> bool:
    """Whether values take at most :data:`MAX_LEVEL_FRACTION` times as many distinct values as
    frames hold them (``copies`` as in :func:`grid_step`)."""
    return len(values.unique()) <= MAX_LEVEL_FRACTION * values.numel() / copies


def dequantize_features(
    raw: Tensor, mask: Tensor, fit_rows: int, generator: torch.Generator, source: str,
    copies: int = 1,
) -> Tensor:
    r"""Dequantise every feature of users' sequences that is on a grid (:func:`grid_step`).

    The grid of feature :math:`d` is found on the observed values of the first ``fit_rows``
    sequences (the training file's); every observed value of that feature, in all sequences (a
    test file's too), gets centred uniform noise of one step
    (:func:`~iresflow.data.preprocessing.uniform_dequantize`). A ``UserWarning`` names the
    dequantised features and their steps, and another the features whose values repeat as
    much but lie on no regular grid (left as they are).

    Args:
        raw: Sequences ``(B, N, D)``, floating point (any value where not observed).
        mask: Boolean ``(B, N)``, the observed frames.
        fit_rows: How many leading sequences the grids are found on.
        generator: CPU ``torch.Generator`` of the noise (drawn ``(B, N)`` per dequantised
            feature, in feature order).
        source: The data's name, for the warnings.
        copies: How many overlapping windows can hold one frame (:func:`grid_step`).

    Returns:
        Sequences ``(B, N, D)``, ``raw`` with its quantised features dequantised.
    """
    out = raw.clone()
    done, gridless = [], []
    for d in range(raw.shape[2]):
        fit = raw[:fit_rows, :, d][mask[:fit_rows]]
        step = grid_step(fit, copies)
        if step is None:
            if fit.numel() and repeats(fit, copies):
                gridless.append(str(d))
            continue
        noisy = uniform_dequantize(raw[..., d], step, centred=True, generator=generator)
        out[..., d] = torch.where(mask, noisy, raw[..., d])
        done.append(f"{d} (step {step:.4g})")
    if done:
        warnings.warn(f"{source}: feature(s) {', '.join(done)} take few values on a regular grid: "
                      f"dequantised with uniform noise of one step (dequantize = off keeps the "
                      f"values as read; docs/datasets.md#quantised)", UserWarning, stacklevel=4)
    if gridless:
        warnings.warn(f"{source}: feature(s) {', '.join(gridless)} repeat a few values, not on a "
                      f"regular grid, and are left as read: a continuous density can pile up on "
                      f"them (docs/datasets.md#quantised)", UserWarning, stacklevel=4)
    return out
