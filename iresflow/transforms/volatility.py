r"""A scale of every frame that follows the size of the frames before it: an ARCH model over
frames, as a flow step (docs/math.md#volatility-step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from iresflow._validation import check_int
from iresflow.transforms.actnorm import DataInitializedTransform, tokenwise_result
from iresflow.transforms.base import LogDetRequest
from iresflow.transforms.settling import SettlingStep
from iresflow.transforms.temporal import history_lengths

__all__ = ["VolatilityScale"]

# Raw values before initialisation: a variance floor of softplus(0.5413) = 1.0 and lag weights
# of about 1e-3, close to the identity.
_RAW_FLOOR, _RAW_WEIGHT = 0.5413, -6.9
# The initial fit keeps every lag weight at least this, and the floor at least this fraction of
# the mean square of its feature.
_MIN_WEIGHT, _MIN_FLOOR_FRACTION = 1e-4, 0.05


class VolatilityScale(SettlingStep, DataInitializedTransform):
    r"""Divide every real frame by a scale computed from the squares of the ``order`` frames
    before it.

    From data to noise (docs/math.md#volatility-step),

    .. math::
        y_t = x_t \oslash \sigma_t, \qquad
        \sigma_t^2 = \omega + \sum_{j=1}^{q} A_j\, (x_{t-j} \odot x_{t-j}), \qquad
        \log|\det J| = -\tfrac12 \sum_{t \text{ real}} \sum_{d=1}^{D} \log \sigma^2_{t,d},

    with :math:`\omega = \mathrm{softplus}(\cdot) > 0` per feature and the entries of the
    :math:`D \times D` matrices :math:`A_j = \mathrm{softplus}(\cdot)` non-negative, so every
    :math:`\sigma_t^2 \ge \omega > 0`. Frames before the start and padded or missing frames add
    nothing to a variance, so padding never influences a real frame. The Jacobian over the real
    frames is block lower triangular with diagonal blocks :math:`\mathrm{diag}(1/\sigma_t)`,
    hence the exact log-determinant. A recording whose movement comes in bursts between pauses
    gets a large scale in a burst and a small one in a pause, which a scale per sequence (the
    sequence-level t base) cannot give. A ``(B, D)`` batch of vectors is a batch of one-frame
    sequences, divided by :math:`\sqrt\omega`.

    Initialisation (:class:`~iresflow.transforms.actnorm.DataInitializedTransform`): the
    regression of every squared frame on its :math:`q` squared predecessors by least squares
    (the moment estimator of an ARCH model), over the real frames with :math:`q` real
    predecessors, its weights raised to at least :math:`10^{-4}` and the floor then set so that
    the mean variance is the mean square, but at least :math:`0.05` of it. Without enough such
    frames (:math:`qD + 2` or more) the step stays close to the identity (:math:`\omega = 1`,
    weights about :math:`10^{-3}`).

    The inverse is the fixed point of :math:`T_y(x)_t = y_t \odot \sigma_t(x_{<t})`, solved by
    :func:`~iresflow.inverse.causal.causal_fixed_point_inverse` (frames settle in order; with
    the default window of all frames, each sweep is a few products over the whole sequence).

    Args:
        features: Frame size ``D``.
        order: Number ``q >= 1`` of earlier frames the variance reads.
        inverse_tol: Max-abs tolerance of a frame's step in the inverse (``None``: the dtype
            default).
        inverse_max_iter: Cap on the sweeps of the inverse (``None``: ``N``).
        inverse_window: Frames evaluated per sweep of the inverse (``None``: all).
        on_failure: ``"raise"`` or ``"warn"`` when the inverse does not settle every frame.

    Example:
        >>> step = VolatilityScale(2, order=3).double()
        >>> x = torch.randn(4, 9, 2, dtype=torch.float64)
        >>> step.initialize(x)
        >>> y, logabsdet = step(x)
        >>> x_back, inverse_logabsdet = step.inverse(y)
        >>> torch.allclose(x_back, x), torch.allclose(inverse_logabsdet, -logabsdet)
        (True, True)
    """

    def __init__(
        self,
        features: int,
        order: int = 3,
        *,
        inverse_tol: float | None = None,
        inverse_max_iter: int | None = None,
        inverse_window: int | None = None,
        on_failure: Literal["raise", "warn"] = "raise",
    ) -> None:
        super().__init__(inverse_tol=inverse_tol, inverse_max_iter=inverse_max_iter,
                         inverse_window=inverse_window, on_failure=on_failure)
        self.features = check_int(features, "features", 1)
        self.order = check_int(order, "order", 1)
        self.raw_floor = nn.Parameter(torch.full((features,), _RAW_FLOOR))
        self.raw_weights = nn.Parameter(torch.full((order * features, features), _RAW_WEIGHT))

    def variance(self, x: Tensor, mask: Tensor | None = None, start: int = 0,
                 stop: int | None = None) -> Tensor:
        r""":math:`\sigma_t^2` of frames ``start`` to ``stop - 1`` (default: to the end).

        Args:
            x: Frames ``(B, N, D)``; only frames ``start - q`` to ``stop - 2`` are read.
            mask: Optional boolean padding mask ``(B, N)``.
            start: First frame.
            stop: End of the frames (default ``N``).

        Returns:
            ``(B, stop - start, D)``, at least :math:`\omega`.
        """
        stop = x.shape[1] if stop is None else stop
        lags = self._lagged_squares(x, mask, start, stop)
        return F.softplus(self.raw_floor) + lags @ F.softplus(self.raw_weights)

    def _lagged_squares(self, x: Tensor, mask: Tensor | None, start: int, stop: int) -> Tensor:
        """``(B, stop - start, q D)``: for every frame ``start`` to ``stop - 1`` of ``x``
        ``(B, N, D)``, the squares of its ``q`` predecessors (``[..., (j - 1) D : j D]`` frame
        ``t - j``), zero before the start and at padded frames."""
        first = start - self.order  # the earliest frame read
        part = x[:, max(first, 0) : max(stop - 1, 0)]
        if mask is not None:
            part = torch.where(mask[:, max(first, 0) : max(stop - 1, 0), None], part, 0.0)
        # squares of frames first .. stop - 2, zeros before the start
        squares = F.pad(part.square(), (0, 0, max(-first, 0), 0))
        width = stop - start
        return torch.cat([squares[:, self.order - j : self.order - j + width]
                          for j in range(1, self.order + 1)], dim=-1)

    def _initialize(self, inputs: Tensor, mask: Tensor | None) -> None:
        x = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        # real frames whose q predecessors are real
        usable = history_lengths(x, mask, self.order) == self.order
        if mask is not None:
            usable &= mask
        if int(usable.sum()) < self.order * self.features + 2:
            return
        lags = self._lagged_squares(x, mask, 0, x.shape[1])[usable].double()
        targets = x[usable].square().double()
        regressors = torch.cat([torch.ones_like(lags[:, :1]), lags], dim=1)
        fit = torch.linalg.lstsq(regressors, targets).solution
        weights = fit[1:].clamp_min(_MIN_WEIGHT)
        mean = targets.mean(0)
        floor = (mean - lags.mean(0) @ weights).clamp_min(
            _MIN_FLOOR_FRACTION * mean).clamp_min(torch.finfo(x.dtype).tiny)
        self.raw_weights.copy_(_softplus_inverse(weights))
        self.raw_floor.copy_(_softplus_inverse(floor))

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        x = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        variance = self.variance(x, mask)
        y, logabsdet = tokenwise_result(x, x * variance.rsqrt(), mask,
                                        -0.5 * variance.log().sum(-1), logdet)
        return (y.squeeze(1) if inputs.dim() == 2 else y), logabsdet

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        y = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        x, logabsdet = self._solve(y, context, mask), None
        if logdet is not False:
            with torch.no_grad():
                x, logabsdet = tokenwise_result(y, x, mask,
                                                0.5 * self.variance(x, mask).log().sum(-1), logdet)
        return (x.squeeze(1) if inputs.dim() == 2 else x), logabsdet

    def _image(self, target: Tensor, context: Tensor | None, mask: Tensor | None,
               memory: Tensor | None = None) -> Callable[[Tensor, int, int], Tensor]:
        def image(x: Tensor, start: int, stop: int) -> Tensor:  # T_y(x) on the window
            value = target[:, start:stop] * self.variance(x, mask, start, stop).sqrt()
            return value if mask is None else torch.where(mask[:, start:stop, None], value, 0.0)

        return image

    def extra_repr(self) -> str:
        return f"features={self.features}, order={self.order}, {super().extra_repr()}"


def _softplus_inverse(value: Tensor) -> Tensor:
    """The raw parameter whose softplus is ``value`` (positive)."""
    return value + torch.log(-torch.expm1(-value))
