r"""Scores of probabilistic forecasts from samples: CRPS, energy score, interval coverage.

A forecast is a set of :math:`S` draws of the next :math:`H` frames; the observed frames are
scored against them with the rules forecasters use (docs/forecasting.md#forecast-scores):

* the continuous ranked probability score of every value, per feature,
  :math:`\mathrm{CRPS}(F, y) = \mathbb{E}|X - y| - \tfrac12 \mathbb{E}|X - X'|`;
* the energy score of every sequence's whole forecast window (all :math:`H \times D` values at
  once), :math:`\mathrm{ES}(F, y) = \mathbb{E}\lVert X - y \rVert - \tfrac12
  \mathbb{E}\lVert X - X' \rVert`, which also rewards the right dependence between frames;
* the fraction of values inside the central 50% and 90% intervals of the draws.

Both scores are estimated without bias from the draws (the "fair" estimators, which average
:math:`|x_i - x_j|` over pairs :math:`i \ne j`), so forecasts of different sample sizes compare
fairly; lower is better, and both equal the mean absolute error for a point forecast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from iresflow._validation import check_sequence

__all__ = [
    "INTERVALS", "QUANTILES", "crps", "energy_score", "forecast_scores", "interval_coverage",
]

#: Central intervals whose coverage :func:`forecast_scores` reports.
INTERVALS = (0.5, 0.9)
#: The quantile levels of the ends of the :data:`INTERVALS` and the median, in increasing order
#: (0.05, 0.25, 0.5, 0.75, 0.95): what forecasts save and fan charts draw.
QUANTILES = tuple(sorted({0.5, *(round((1 + side * level) / 2, 12)
                                 for level in INTERVALS for side in (-1, 1))}))


def crps(samples: Tensor, truth: Tensor) -> Tensor:
    r"""Unbiased CRPS of every value from ``S >= 2`` draws.

    With the draws sorted, :math:`x_{(1)} \le \dots \le x_{(S)}`,

    .. math:: \widehat{\mathrm{CRPS}} = \frac1S \sum_i |x_i - y|
        - \frac{1}{S(S-1)} \sum_k (2k - S - 1)\, x_{(k)},

    the second term being half the mean of :math:`|x_i - x_j|` over the :math:`S(S-1)` ordered
    pairs :math:`i \ne j`.

    Args:
        samples: Draws ``(S, ...)``.
        truth: Observed values ``(...)``, the shape of one draw.

    Returns:
        The score of every value, shape ``(...)``, in the values' dtype.

    Raises:
        ValueError: fewer than two draws, or shapes that disagree.

    Example:
        >>> draws = torch.tensor([[0.0], [2.0]])
        >>> crps(draws, torch.tensor([1.0]))  # E|X - 1| = 1, E|X - X'| over i != j = 2
        tensor([0.])
    """
    count = _check_draws(samples, truth)
    spread = torch.arange(1, count + 1, dtype=samples.dtype, device=samples.device)
    spread = (2 * spread - count - 1).reshape((count,) + (1,) * truth.dim())
    pairs = (samples.sort(dim=0).values * spread).sum(0) / (count * (count - 1))
    return (samples - truth).abs().mean(0) - pairs


def energy_score(samples: Tensor, truth: Tensor) -> Tensor:
    r"""Unbiased energy score of every forecast vector from ``S >= 2`` draws.

    .. math:: \widehat{\mathrm{ES}} = \frac1S \sum_i \lVert x_i - y \rVert
        - \frac{1}{2S(S-1)} \sum_{i \ne j} \lVert x_i - x_j \rVert

    (Euclidean norms); for vectors of length one it is :func:`crps`.

    Args:
        samples: Draws ``(S, B, M)``: ``B`` forecasts of ``M`` values each.
        truth: Observed vectors ``(B, M)``.

    Returns:
        Shape ``(B,)``.

    Raises:
        ValueError: fewer than two draws, or shapes that disagree.

    Example:
        >>> draws = torch.tensor([[[0.0, 0.0]], [[3.0, 4.0]]])
        >>> energy_score(draws, torch.zeros(1, 2))  # (0 + 5) / 2 - 5 / 2
        tensor([0.])
    """
    count = _check_draws(samples, truth)
    if truth.dim() != 2:
        raise ValueError(f"truth must have shape (B, M), got {tuple(truth.shape)}")
    error = (samples - truth).norm(dim=-1).mean(0)  # (B,)
    by_sequence = samples.transpose(0, 1)  # (B, S, M)
    spread = torch.cdist(by_sequence, by_sequence).sum((1, 2)) / (count * (count - 1))
    return error - spread / 2


def interval_coverage(
    samples: Tensor, truth: Tensor, level: float
) -> Tensor:
    """Whether every value lies in the central ``level`` interval of its draws.

    The interval runs from the ``(1 - level) / 2`` to the ``(1 + level) / 2`` quantile of the
    draws (linear interpolation, as :func:`torch.quantile`), both ends included.

    Args:
        samples: Draws ``(S, ...)``.
        truth: Observed values ``(...)``.
        level: Nominal coverage in ``(0, 1)``.

    Returns:
        Boolean tensor ``(...)``.

    Raises:
        ValueError: a level outside ``(0, 1)``, or shapes that disagree.

    Example:
        >>> draws = torch.linspace(0.0, 1.0, 101)[:, None]
        >>> interval_coverage(draws, torch.tensor([0.5]), 0.5).tolist()
        [True]
    """
    _check_draws(samples, truth)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    tails = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=samples.dtype,
                         device=samples.device)
    low, high = torch.quantile(samples, tails, dim=0)
    return (truth >= low) & (truth <= high)


def forecast_scores(samples: Tensor, truth: Tensor, mask: Tensor) -> dict[str, object]:
    """The scores of forecasts of sequences against the frames that followed.

    Args:
        samples: Draws ``(S, B, H, D)`` of ``B`` forecasts of ``H`` frames.
        truth: The frames that followed ``(B, H, D)``.
        mask: Which of them are real ``(B, H)``, bool; the others (gaps, the end of a sequence)
            are not scored; a forecast may have none.

    Returns:
        ``{"crps": [D floats], "crps_mean", "energy", "coverage": {"50": ..., "90": ...},
        "frames", "sequences"}``: the CRPS of every feature averaged over the real frames,
        their mean over the features, the energy score averaged over the sequences with every
        frame real (``nan`` when there is none), the fraction of real values inside each
        central interval (:data:`INTERVALS`), and the counts scored.

    Raises:
        ValueError: shapes that disagree, or no real frame.

    Example:
        >>> draws = torch.randn(200, 3, 4, 2, generator=torch.Generator().manual_seed(0))
        >>> scores = forecast_scores(draws, torch.zeros(3, 4, 2), torch.ones(3, 4, dtype=bool))
        >>> scores["frames"], len(scores["crps"])
        (12, 2)
    """
    check_sequence(truth, "truth", allow_2d=False)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != truth.shape[:2]:
        raise ValueError(f"mask must be a boolean tensor of shape (B, H) = "
                         f"{tuple(truth.shape[:2])}")
    if samples.dim() != 4:
        raise ValueError(f"samples must have shape (S, B, H, D), got {tuple(samples.shape)}")
    frames = int(mask.sum())
    if frames == 0:
        raise ValueError("mask marks no real frame to score")
    per_value = crps(samples, truth)[mask]  # (frames, D)
    full = mask.all(-1)
    energy = float("nan") if not bool(full.any()) else float(energy_score(
        samples[:, full].flatten(2), truth[full].flatten(1)).mean())
    coverage = {f"{round(100 * level)}": float(
        interval_coverage(samples, truth, level)[mask].double().mean()) for level in INTERVALS}
    return {
        "crps": per_value.double().mean(0).tolist(),
        "crps_mean": float(per_value.double().mean()),
        "energy": energy,
        "coverage": coverage,
        "frames": frames,
        "sequences": int(mask.any(-1).sum()),
    }


def _check_draws(samples: Tensor, truth: Tensor) -> int:
    """The number of draws, after checking that there are two or more of ``truth``'s shape."""
    for name, value in (("samples", samples), ("truth", truth)):
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
    if samples.dim() != truth.dim() + 1 or samples.shape[1:] != truth.shape:
        raise ValueError(f"samples must have shape (S, *truth.shape) = (S, "
                         f"{', '.join(map(str, truth.shape))}), got {tuple(samples.shape)}")
    if samples.shape[0] < 2:
        raise ValueError(f"samples must hold at least 2 draws, got {samples.shape[0]}")
    return samples.shape[0]
