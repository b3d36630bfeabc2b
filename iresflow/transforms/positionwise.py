r"""A per-position affine map: sequences whose frames have a different law at every position.

Daily profiles, image rows and aligned recordings have a mean and a spread that depend on where
in the sequence a frame is. :class:`PositionwiseAffine` standardises every position
separately, with an exact, token-wise log-determinant (docs/math.md#positionwise-affine);
:func:`positionwise_moments` is the initialisation that the layer and the evidence test of
:func:`iresflow.models.reference.positionwise_evidence` share.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from iresflow._validation import check_int
from iresflow.transforms.actnorm import DataInitializedTransform, tokenwise_result
from iresflow.transforms.base import LogDetRequest

__all__ = ["PositionwiseAffine", "positionwise_moments"]

#: Floor of a position's variance, as a fraction of the variance of all real frames of that
#: feature (docs/math.md#positionwise-affine): a position where every training sequence has
#: nearly the same value is not given an unbounded scale.
RELATIVE_POSITION_VARIANCE_FLOOR = 1e-2
#: Fewest real frames a position needs for its own moments; with fewer it takes the pooled ones.
MIN_FRAMES_PER_POSITION = 2


def positionwise_moments(
    x: Tensor, mask: Tensor | None, max_len: int | None = None
) -> tuple[Tensor, Tensor]:
    r"""Mean and floored variance of every position and feature over the real frames.

    A position with fewer than :data:`MIN_FRAMES_PER_POSITION` real frames (or beyond the
    longest sequence of ``x``) takes the pooled mean and variance of all real frames; every
    variance is at least :data:`RELATIVE_POSITION_VARIANCE_FLOOR` times the pooled one (and
    ``1e-12``).

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Optional boolean padding mask ``(B, N)``.
        max_len: Number of positions to return (default ``N``; at least ``N``).

    Returns:
        ``(mean, variance)``, each ``(max_len, D)`` in the dtype of ``x``.

    Example:
        >>> mean, var = positionwise_moments(torch.arange(6.0).reshape(2, 3, 1), None)
        >>> mean.squeeze(-1).tolist(), var.squeeze(-1).tolist()
        ([1.5, 2.5, 3.5], [2.25, 2.25, 2.25])
    """
    batch, length, features = x.shape
    max_len = length if max_len is None else max_len
    if max_len < length:
        raise ValueError(f"max_len must be >= the sequence length {length}, got {max_len}")
    real = torch.ones(batch, length, dtype=torch.bool, device=x.device) if mask is None else mask
    weights = real.unsqueeze(-1).to(x.dtype)
    pooled_mean = (x * weights).sum((0, 1)) / weights.sum((0, 1))
    pooled_var = ((x - pooled_mean).square() * weights).sum((0, 1)) / weights.sum((0, 1))
    counts = weights.sum(0)  # (N, 1)
    own = counts >= MIN_FRAMES_PER_POSITION
    mean = torch.where(own, (x * weights).sum(0) / counts.clamp_min(1), pooled_mean)
    var = torch.where(own, ((x - mean).square() * weights).sum(0) / counts.clamp_min(1),
                      pooled_var)
    var = torch.maximum(var, (RELATIVE_POSITION_VARIANCE_FLOOR * pooled_var).clamp_min(1e-12))
    pad = max_len - length
    mean = torch.cat([mean, pooled_mean.expand(pad, features)])
    var = torch.cat([var, pooled_var.clamp_min(1e-12).expand(pad, features)])
    return mean, var


class PositionwiseAffine(DataInitializedTransform):
    r"""An affine map with its own shift and scale at every position and feature.

    For the real token :math:`x_t \in \mathbb R^D` at position :math:`t` of a sequence
    (docs/math.md#positionwise-affine),

    .. math::
        y_t = (x_t + b_t) \odot e^{s_t}, \qquad x_t = y_t \odot e^{-s_t} - b_t, \qquad
        \log|\det J| = \sum_{t\,:\,m_t = 1} \sum_{d=1}^{D} s_{t,d} ,

    with :math:`b, s \in \mathbb R^{N_{\max} \times D}`. Padded tokens are returned unchanged and
    do not enter the log-determinant; a ``(B, D)`` batch of vectors is treated as sequences of
    length 1 (position 0). Sequences longer than ``max_len`` are refused.

    Initialisation (:class:`~iresflow.transforms.actnorm.DataInitializedTransform`):
    :meth:`initialize` sets :math:`b_t = -\mathrm{mean}_t` and
    :math:`s_t = -\tfrac12\log\mathrm{var}_t` from :func:`positionwise_moments` of that batch,
    so that every position of it has zero mean and unit variance.

    Args:
        features: Feature size ``D``.
        max_len: Number of positions ``N_max``.

    Example:
        >>> layer = PositionwiseAffine(2, max_len=5)
        >>> x = torch.randn(8, 5, 2) * torch.arange(1.0, 6.0).view(1, 5, 1)
        >>> layer.initialize(x)
        >>> y, logabsdet = layer(x)
        >>> y.shape, logabsdet.shape, torch.allclose(layer.inverse(y)[0], x, atol=1e-5)
        (torch.Size([8, 5, 2]), torch.Size([8]), True)
    """

    causal = True  # frame-wise

    def __init__(self, features: int, max_len: int) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.max_len = check_int(max_len, "max_len", 1)
        self.shift = nn.Parameter(torch.zeros(self.max_len, self.features))
        self.log_scale = nn.Parameter(torch.zeros(self.max_len, self.features))

    def _check_options(self, inputs: Tensor, context: Tensor | None, logdet: object) -> None:
        length = inputs.shape[1] if inputs.dim() == 3 else 1
        if length > self.max_len:
            raise ValueError(
                f"sequence length N={length} exceeds max_len={self.max_len} of "
                "PositionwiseAffine, which has parameters for that many positions only"
            )

    def _table(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Shift and log-scale of the input's positions, ``(N, D)`` (``(D,)`` for vectors)."""
        if inputs.dim() == 2:
            return self.shift[0], self.log_scale[0]
        length = inputs.shape[1]
        return self.shift[:length], self.log_scale[:length]

    def _per_token(self, inputs: Tensor, log_scale: Tensor) -> Tensor:
        """Log-determinant of every token's block, ``(B, N)`` (``(B, 1)`` for vectors)."""
        per_position = log_scale.sum(-1).reshape(1, -1)
        return per_position.expand(inputs.shape[0], per_position.shape[1])

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Data to noise, :math:`y_t = (x_t + b_t)\odot e^{s_t}`."""
        shift, log_scale = self._table(inputs)
        outputs = (inputs + shift) * torch.exp(log_scale)
        return tokenwise_result(inputs, outputs, mask, self._per_token(inputs, log_scale),
                                logdet)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Noise to data, :math:`x_t = y_t \odot e^{-s_t} - b_t`."""
        shift, log_scale = self._table(inputs)
        outputs = inputs * torch.exp(-log_scale) - shift
        return tokenwise_result(inputs, outputs, mask, -self._per_token(inputs, log_scale),
                                logdet)

    def _initialize(self, inputs: Tensor, mask: Tensor | None) -> None:
        x = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        mean, var = positionwise_moments(x, mask, self.max_len)
        self.shift.copy_(-mean)
        self.log_scale.copy_(-0.5 * torch.log(var))

    def extra_repr(self) -> str:
        return f"features={self.features}, max_len={self.max_len}"
