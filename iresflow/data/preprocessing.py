r"""Invertible preprocessing of sequence data and its log-Jacobian.

A dataset stores sequences in *model space* :math:`x = T(r)`, where :math:`r` is the data in its
original units (*raw space*). Every map here returns, next to :math:`x`, the per-sequence
log-Jacobian :math:`\log|\det \partial T / \partial r|` over the real frames, so that densities
convert between the two spaces by the change-of-variables formula

.. math::

    \log p_{\mathrm{raw}}(r) = \log p_{\mathrm{model}}(T(r)) + \log\left|\det
    \frac{\partial T}{\partial r}\right|.

Padded frames (``mask`` ``False``) are set to zero and never enter a log-Jacobian.

Uniform dequantisation (:func:`uniform_dequantize`) is not a bijection but the addition of noise
that turns discrete values into a continuous variable whose density is compared across models;
it contributes nothing to the log-Jacobian.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from iresflow._validation import check_finite, check_mask, check_sequence

__all__ = [
    "LogitTransform",
    "Preprocessing",
    "Standardization",
    "interpolate_gaps",
    "uniform_dequantize",
]


class Preprocessing(Protocol):
    """An invertible, frame-wise map from raw space to model space."""

    def forward(self, raw: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Map raw sequences ``(B, N, D)`` to model space; return ``(x, log_jacobian (B,))``."""
        ...

    def inverse(self, x: Tensor, mask: Tensor) -> Tensor:
        """Map model-space sequences ``(B, N, D)`` back to raw space."""
        ...


def _check_pair(values: Tensor, mask: Tensor, name: str) -> Tensor:
    check_sequence(values, name, allow_2d=False)
    checked = check_mask(mask, values)
    assert checked is not None
    return checked


@dataclass(frozen=True)
class Standardization:
    r"""Per-feature standardisation :math:`x = (r - \mu) / \sigma`.

    The statistics are fitted on the real frames of a training set (:meth:`fit`). For a sequence
    with :math:`n` real frames of :math:`D` features, the log-Jacobian is

    .. math:: \log\left|\det \frac{\partial x}{\partial r}\right| = -n \sum_{d=1}^{D} \log\sigma_d.

    Attributes:
        mean: Per-feature mean :math:`\mu`, shape ``(D,)``, float64.
        std: Per-feature standard deviation :math:`\sigma > 0`, shape ``(D,)``, float64.

    Example:
        >>> raw = torch.tensor([[[1.0], [3.0]]], dtype=torch.float64)
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> x, logjac = Standardization.fit(raw, mask).forward(raw, mask)
        >>> x.flatten().tolist(), logjac.tolist()
        ([-1.0, 1.0], [-0.0])
    """

    mean: Tensor
    std: Tensor

    def __post_init__(self) -> None:
        if self.mean.dim() != 1 or self.std.shape != self.mean.shape:
            raise ValueError(
                f"mean and std must both have shape (D,), got {tuple(self.mean.shape)} and "
                f"{tuple(self.std.shape)}"
            )
        check_finite(self.mean, "mean")
        check_finite(self.std, "std")
        if not bool((self.std > 0).all()):
            raise ValueError("std must be strictly positive in every feature")

    @classmethod
    def fit(cls, raw: Tensor, mask: Tensor) -> Standardization:
        r"""Fit mean and (maximum-likelihood, divide-by-:math:`n`) standard deviation.

        Args:
            raw: Training sequences, shape ``(B, N, D)``.
            mask: Boolean padding mask ``(B, N)``, ``True`` for real frames; only these count.

        Returns:
            The fitted standardisation (float64 statistics on ``raw``'s device).

        Raises:
            ValueError: fewer than two real frames, or a feature that is constant over them.
        """
        mask = _check_pair(raw, mask, "raw")
        frames = raw[mask].to(torch.float64)
        if frames.shape[0] < 2:
            raise ValueError("standardisation needs at least two real frames to fit")
        return cls._from_moments(frames.mean(dim=0), frames.std(dim=0, correction=0))

    @classmethod
    def fit_chunks(cls, chunks: Iterable[Tensor]) -> Standardization:
        r"""Fit like :meth:`fit` in one streaming pass over chunks of real frames.

        Each chunk's count, mean and sum of squared deviations are merged into the running ones
        (Chan, Golub and LeVeque's pairwise update, stable in float64), so the data never need
        to be in memory together.

        Args:
            chunks: Real frames in chunks of shape ``(t, D)``, ``t >= 1``.

        Returns:
            The fitted standardisation (float64 statistics on the CPU).

        Raises:
            ValueError: chunks of different ``D``, non-finite values, fewer than two frames, or a
                constant feature.

        Example:
            >>> frames = torch.randn(100, 3, dtype=torch.float64)
            >>> streamed = Standardization.fit_chunks(frames.split(7))
            >>> mask = torch.ones(1, 100, dtype=torch.bool)
            >>> whole = Standardization.fit(frames.unsqueeze(0), mask)
            >>> torch.allclose(streamed.std, whole.std), torch.allclose(streamed.mean, whole.mean)
            (True, True)
        """
        count, mean, squares = 0, None, None
        for chunk in chunks:
            if not isinstance(chunk, Tensor) or chunk.dim() != 2 or chunk.shape[0] == 0:
                raise ValueError("every chunk of frames must be a tensor of shape (t, D), t >= 1")
            chunk = check_finite(chunk.to(device="cpu", dtype=torch.float64), "chunk")
            chunk_mean = chunk.mean(dim=0)
            chunk_squares = (chunk - chunk_mean).square().sum(dim=0)
            if mean is None or squares is None:
                count, mean, squares = chunk.shape[0], chunk_mean, chunk_squares
                continue
            if chunk.shape[1] != mean.shape[0]:
                raise ValueError(f"chunks must all have D = {mean.shape[0]} columns")
            total = count + chunk.shape[0]
            delta = chunk_mean - mean
            mean = mean + delta * (chunk.shape[0] / total)
            squares = squares + chunk_squares + delta.square() * (count * chunk.shape[0] / total)
            count = total
        if mean is None or squares is None or count < 2:
            raise ValueError("standardisation needs at least two real frames to fit")
        return cls._from_moments(mean, (squares / count).sqrt())

    @classmethod
    def _from_moments(cls, mean: Tensor, std: Tensor) -> Standardization:
        constant = (std <= 0).nonzero().flatten().tolist()
        if constant:
            raise ValueError(
                f"feature(s) {constant} are constant over the training frames; cannot standardise"
            )
        return cls(mean=mean, std=std)

    def log_jacobian(self, frames: Tensor) -> Tensor:
        r"""Log-Jacobian :math:`-n \sum_d \log\sigma_d` of sequences of ``frames`` real frames.

        Args:
            frames: Real frames per sequence, shape ``(B,)``, integer.

        Returns:
            Shape ``(B,)``, float64.

        Example:
            >>> scale = Standardization(torch.zeros(1, dtype=torch.float64),
            ...                         torch.full((1,), 2.0, dtype=torch.float64))
            >>> scale.log_jacobian(torch.tensor([0, 1])).tolist()
            [-0.0, -0.6931471805599453]
        """
        return -frames.to(torch.float64) * self.std.to(frames.device).log().sum()

    def forward(self, raw: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Standardise the real frames of ``raw``.

        Args:
            raw: Sequences in raw space, shape ``(B, N, D)``.
            mask: Boolean padding mask ``(B, N)``.

        Returns:
            ``x`` of shape ``(B, N, D)`` in ``raw``'s dtype (zero at padding) and the log-Jacobian
            of shape ``(B,)``, float64.
        """
        mask = _check_pair(raw, mask, "raw")
        mean, std = self.mean.to(raw.device), self.std.to(raw.device)
        real = mask.unsqueeze(-1)
        x = torch.where(real, (raw.to(torch.float64) - mean) / std, 0.0).to(raw.dtype)
        return x, self.log_jacobian(mask.sum(dim=1))

    def inverse(self, x: Tensor, mask: Tensor) -> Tensor:
        r"""Undo the standardisation, :math:`r = \mu + \sigma x` (zero at padding).

        Args:
            x: Sequences in model space, shape ``(B, N, D)``.
            mask: Boolean padding mask ``(B, N)``.

        Returns:
            Raw sequences, shape ``(B, N, D)``, in ``x``'s dtype.
        """
        mask = _check_pair(x, mask, "x")
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        raw = torch.where(mask.unsqueeze(-1), x.to(torch.float64) * std + mean, 0.0)
        return raw.to(x.dtype)


@dataclass(frozen=True)
class LogitTransform:
    r"""Scaled logit of dequantised values in :math:`[0, L)` (RealNVP's squeeze).

    With :math:`L` = ``levels`` and :math:`\alpha` = ``alpha``, each value :math:`r \in [0, L)` maps
    to

    .. math:: p = \alpha + (1 - 2\alpha)\,\frac{r}{L}, \qquad x = \log p - \log(1 - p),

    so :math:`x` stays in :math:`[\operatorname{logit}\alpha, -\operatorname{logit}\alpha]`. Per
    dimension the log-derivative is :math:`-\log L + \log(1 - 2\alpha) - \log p - \log(1 - p)`;
    the log-Jacobian of a sequence sums it over every dimension of its real frames.

    Attributes:
        levels: Number of discrete levels :math:`L` (values lie in ``[0, levels)``).
        alpha: Squeeze :math:`\alpha \in (0, 1/2)` that keeps the logit finite.

    Example:
        >>> t = LogitTransform(levels=2, alpha=0.25)
        >>> x, logjac = t.forward(torch.ones(1, 1, 1), torch.ones(1, 1, dtype=torch.bool))
        >>> x.item(), logjac.item()  # p = 1/2: -log 2 + log(1/2) + 2 log 2 = 0
        (0.0, 0.0)
    """

    levels: int
    alpha: float

    def __post_init__(self) -> None:
        if isinstance(self.levels, bool) or not isinstance(self.levels, int) or self.levels < 1:
            raise ValueError(f"levels must be a positive int, got {self.levels!r}")
        if not 0.0 < self.alpha < 0.5:
            raise ValueError(f"alpha must lie in (0, 1/2), got {self.alpha!r}")

    def forward(self, raw: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Map dequantised values to logit space.

        Args:
            raw: Values in ``[0, levels]`` at real frames, shape ``(B, N, D)``.
            mask: Boolean padding mask ``(B, N)``.

        Returns:
            ``x`` of shape ``(B, N, D)`` in ``raw``'s dtype (zero at padding) and the log-Jacobian
            of shape ``(B,)``, float64.

        Raises:
            ValueError: a real value outside ``[0, levels]``.
        """
        mask = _check_pair(raw, mask, "raw")
        real = mask.unsqueeze(-1)
        values = torch.where(real, raw.to(torch.float64), 0.0)
        if bool(((values < 0) | (values > self.levels)).any()):
            raise ValueError(f"raw values at real frames must lie in [0, {self.levels}]")
        p = self.alpha + (1.0 - 2.0 * self.alpha) * values / self.levels
        x = torch.where(real, p.log() - (-p).log1p(), 0.0)
        const = math.log1p(-2.0 * self.alpha) - math.log(self.levels)
        per_dim = torch.where(real, const - p.log() - (-p).log1p(), 0.0)
        return x.to(raw.dtype), per_dim.sum(dim=(1, 2))

    def inverse(self, x: Tensor, mask: Tensor) -> Tensor:
        r"""Map logit-space values back, :math:`r = L\,(\sigma(x) - \alpha) / (1 - 2\alpha)`.

        Values are not clipped: a model sample outside the squeezed range maps slightly outside
        ``[0, levels)``.

        Args:
            x: Sequences in model space, shape ``(B, N, D)``.
            mask: Boolean padding mask ``(B, N)``.

        Returns:
            Raw sequences, shape ``(B, N, D)``, in ``x``'s dtype, zero at padding.
        """
        mask = _check_pair(x, mask, "x")
        p = torch.sigmoid(x.to(torch.float64))
        raw = self.levels * (p - self.alpha) / (1.0 - 2.0 * self.alpha)
        return torch.where(mask.unsqueeze(-1), raw, 0.0).to(x.dtype)


def uniform_dequantize(
    values: Tensor,
    step: float,
    *,
    centred: bool,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Add uniform noise of one quantisation step to quantised values.

    With :math:`u \sim \mathcal U[0, 1)` drawn independently per entry, returns
    :math:`v + s\,u` (``centred=False``, bins :math:`[v, v + s)`, e.g. integer pixels) or
    :math:`v + s\,(u - 1/2)` (``centred=True``, bins :math:`[v - s/2, v + s/2)`, e.g. values
    rounded to a resolution :math:`s`). A density of the result, integrated over a bin, lower-bounds
    the probability of the discrete value, so its negative log-density per dimension upper-bounds
    the discrete code length.

    Args:
        values: Quantised values, any shape, floating point.
        step: Quantisation step :math:`s > 0`.
        centred: Whether the bin is centred on the value.
        generator: Optional CPU ``torch.Generator`` for reproducible noise.

    Returns:
        Dequantised values, same shape, dtype and device as ``values``.

    Example:
        >>> v = uniform_dequantize(torch.zeros(1000), 1.0, centred=False)
        >>> bool((v >= 0).all() and (v < 1).all())
        True
    """
    if not isinstance(values, Tensor) or not values.is_floating_point():
        raise TypeError("values must be a floating-point torch.Tensor")
    if not step > 0:
        raise ValueError(f"step must be positive, got {step!r}")
    check_finite(values, "values")
    u = torch.rand(values.shape, generator=generator, dtype=values.dtype)
    u = u.to(values.device)
    return values + step * (u - 0.5 if centred else u)


def interpolate_gaps(values: Tensor) -> Tensor:
    r"""Fill NaN gaps of an evenly spaced series by linear interpolation.

    A missing value at index :math:`t` between observed indices :math:`a < t < b` becomes
    :math:`v_a + (v_b - v_a)(t - a)/(b - a)`. Nothing is extrapolated.

    Args:
        values: Series of shape ``(T,)``, floating point, NaN where missing.

    Returns:
        The filled series, shape ``(T,)``, same dtype and device.

    Raises:
        ValueError: not 1-D, Inf values, or a missing first/last value.

    Example:
        >>> interpolate_gaps(torch.tensor([1.0, float("nan"), float("nan"), 4.0])).tolist()
        [1.0, 2.0, 3.0, 4.0]
    """
    if not isinstance(values, Tensor) or not values.is_floating_point() or values.dim() != 1:
        raise ValueError("values must be a 1-D floating-point tensor")
    if bool(torch.isinf(values).any()):
        raise ValueError("values contains Inf")
    observed = ~torch.isnan(values)
    if not (bool(observed[0]) and bool(observed[-1])):
        raise ValueError("the first and last values must be observed (no extrapolation)")
    index = torch.arange(values.shape[0], device=values.device, dtype=values.dtype)
    known = observed.nonzero().flatten()
    # Right neighbour b: the first observed index >= t; left neighbour a: the one before it.
    right = torch.searchsorted(known, torch.arange(values.shape[0], device=values.device))
    left = (right - 1).clamp(min=0)
    a, b = known[left], known[right]
    weight = (index - a) / (b - a).clamp(min=1)  # a == b only at observed indices
    filled = values[a] + weight * (values[b] - values[a])
    return torch.where(observed, values, filled)
