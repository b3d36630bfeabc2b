r"""Classical forecasters of the next frames given observed ones, as draws ``(S, B, H, D)``.

* :func:`seasonal_naive`: the last season of observed frames repeated, with the period chosen
  on held-out validation frames (:func:`choose_period`); a point forecast, so its CRPS is its
  mean absolute error;
* :func:`ar_forecast`: ancestral draws of the closed-form AR(p) Gaussian
  (:class:`iresflow.models.reference.AutoregressiveGaussian`) continued from the last ``p``
  observed frames;
* :func:`ets_forecast`: a damped-trend exponential smoothing state-space model (statsmodels'
  ``ETSModel``) fitted to every univariate sequence's own observed frames, the way a forecaster
  treats one series, and simulated ``S`` times.

Every function takes sequences whose observed frames come first (as
:func:`iresflow.runs.forecast.hold_out` gives them, no gaps), in model space.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor

from iresflow.models.reference import AutoregressiveGaussian

__all__ = ["ar_forecast", "choose_period", "ets_forecast", "seasonal_naive"]

#: Longest season :func:`choose_period` tries.
MAX_PERIOD = 24


def seasonal_naive(x: Tensor, observed: Tensor, horizon: int, period: int) -> Tensor:
    """Repeat every sequence's last ``period`` observed frames (all of them when it has fewer).

    Args:
        x: Sequences ``(B, N, D)``.
        observed: Their observed frames ``(B, N)``, a prefix of every row.
        horizon: Frames to forecast ``H``.
        period: Season ``m >= 1``.

    Returns:
        The point forecast as two identical draws ``(2, B, H, D)``.

    Example:
        >>> x = torch.tensor([[[1.0], [2.0], [3.0], [0.0]]])
        >>> seasonal_naive(x, torch.tensor([[True, True, True, False]]), 3, 2)[0, 0, :, 0]
        tensor([2., 3., 2.])
    """
    start = observed.sum(1)  # (B,)
    season = torch.minimum(start, torch.tensor(period))
    steps = torch.arange(horizon)
    spots = start[:, None] - season[:, None] + steps % season[:, None]  # (B, H)
    point = torch.gather(x, 1, spots[..., None].expand(-1, -1, x.shape[2]))
    return point.expand(2, *point.shape)


def choose_period(x: Tensor, observed: Tensor, truth: Tensor, truth_mask: Tensor) -> int:
    """The season of :func:`seasonal_naive` with the smallest mean absolute error on held-out
    frames (validation data), among ``1..MAX_PERIOD``.

    Args:
        x: Sequences ``(B, N, D)``; ``observed`` ``(B, N)`` their observed frames.
        truth: The frames that followed ``(B, H, D)``; ``truth_mask`` ``(B, H)`` the real ones.

    Returns:
        The chosen period.
    """
    errors = {}
    for period in range(1, MAX_PERIOD + 1):
        point = seasonal_naive(x, observed, truth.shape[1], period)[0]
        errors[period] = float((point - truth).abs()[truth_mask].mean())
    return min(errors, key=errors.__getitem__)


@torch.no_grad()
def ar_forecast(
    model: AutoregressiveGaussian, x: Tensor, observed: Tensor, horizon: int, num: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Ancestral draws of a fitted AR(p) Gaussian after every sequence's observed frames:
    :math:`x_t = b_k + \sum_{j \le k} A_{k,j} x_{t-j} + L_k \varepsilon_t` with
    :math:`k = \min(p, \text{frames so far})`.

    Args:
        model: The fitted model.
        x: Sequences ``(B, N, D)``; ``observed`` ``(B, N)`` their observed frames (a prefix).
        horizon: Frames to draw ``H``.
        num: Draws ``S``.
        generator: Optional generator of the noise.

    Returns:
        ``(S, B, H, D)`` float64.
    """
    order, features = model.order, model.features
    start = observed.sum(1).repeat(num)  # frames so far, per draw
    rows = len(start)
    history = x.double().new_zeros(rows, order, features)  # the last p frames, oldest first
    past = x.double().repeat(num, 1, 1)
    for j in range(order):
        spot = start - order + j
        history[:, j] = torch.where((spot >= 0)[:, None],
                                    past[torch.arange(rows), spot.clamp(min=0)], 0.0)
    frames = []
    for _ in range(horizon):
        lags = torch.minimum(start, torch.tensor(order))
        eps = torch.randn(rows, features, generator=generator, dtype=torch.float64)
        frame = torch.empty(rows, features, dtype=torch.float64)
        for k in lags.unique().tolist():
            pick = lags == k
            recent = history[pick, order - k:].flip(1).reshape(int(pick.sum()), k * features)
            mean = recent @ model.weight[k, : k * features] + model.bias[k]
            frame[pick] = mean + eps[pick] @ model.scale_tril[k].T
        frames.append(frame)
        if order > 0:
            history = torch.cat([history[:, 1:], frame[:, None]], 1)
        start = start + 1
    return torch.stack(frames, 1).reshape(num, len(x), horizon, features)


def ets_forecast(x: Tensor, observed: Tensor, horizon: int, num: int, seed: int) -> Tensor:
    """Draws of a damped-trend ETS(A,Ad,N) model fitted to every univariate sequence alone.

    A sequence too short to fit (fewer than 6 frames) or whose fit fails is forecast by its last
    value with the spread of its frame-to-frame changes.

    Args:
        x: Univariate sequences ``(B, N, 1)``; ``observed`` ``(B, N)`` their observed frames.
        horizon: Frames to draw ``H``.
        num: Draws ``S``.
        seed: Seed of the simulations.

    Returns:
        ``(S, B, H, 1)`` float64.

    Raises:
        ValueError: more than one feature.
    """
    from statsmodels.tsa.exponential_smoothing.ets import ETSModel

    if x.shape[2] != 1:
        raise ValueError(f"ETS forecasts univariate sequences, got {x.shape[2]} features")
    rng = np.random.default_rng(seed)
    draws = np.empty((num, len(x), horizon))
    for b in range(len(x)):
        series = x[b, observed[b], 0].double().numpy()
        try:
            if len(series) < 6:
                raise ValueError("too short")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fitted = ETSModel(series, error="add", trend="add", damped_trend=True).fit(
                    disp=False)
                paths = fitted.simulate(horizon, repetitions=num, anchor="end",
                                        rng=rng)
            draws[:, b] = np.asarray(paths).reshape(horizon, num).T
        except (ValueError, np.linalg.LinAlgError):
            spread = np.diff(series).std() if len(series) > 1 else 1.0
            steps = rng.normal(0.0, spread, (num, horizon)).cumsum(1)
            draws[:, b] = series[-1] + steps
    if not np.isfinite(draws).all():
        raise ValueError("an ETS simulation is not finite")
    return torch.from_numpy(draws)[..., None]
