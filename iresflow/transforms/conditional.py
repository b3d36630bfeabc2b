r"""A conditional element-wise affine map with an exact log-determinant
(docs/math.md#actnorm, docs/math.md#change-of-variables)."""

from __future__ import annotations

import torch
from torch import Tensor

from iresflow._validation import check_float, check_int
from iresflow.nn.conditional import ContextShift, check_context
from iresflow.transforms.actnorm import tokenwise_result
from iresflow.transforms.base import LogDetRequest, SequenceTransform

__all__ = ["ConditionalAffine"]


class ConditionalAffine(SequenceTransform):
    r"""Per-sequence affine map of every real frame, its scale and shift functions of the context.

    .. math:: y_n = x_n \odot e^{s(c)} + t(c), \qquad
        s(c) = S \tanh\big(a(c)\big), \qquad
        \log|\det J| = n_{\rm real} \sum_{d} s_d(c),

    with :math:`(a, t)` an unconstrained small MLP of the context :math:`c` ``(B, C)`` whose last
    layer starts at zero (the map starts as the identity) and :math:`|s_d| \le S`
    (``max_log_scale``) so that the map stays well conditioned for every context. As the last
    step of a conditional flow it makes the base a context-dependent diagonal Gaussian. Padded
    frames pass through unchanged.

    Args:
        features: Feature size ``D``.
        context_features: Context size ``C``.
        hidden: Hidden width of the context network.
        max_log_scale: Bound :math:`S > 0` on every log-scale.

    Example:
        >>> layer = ConditionalAffine(3, 2).double()
        >>> x, c = torch.randn(4, 5, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> y, logabsdet = layer(x, c)
        >>> torch.allclose(layer.inverse(y, c)[0], x), logabsdet.shape
        (True, torch.Size([4]))
    """

    causal = True  # frame-wise

    def __init__(
        self, features: int, context_features: int, hidden: int = 32, max_log_scale: float = 3.0
    ) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.context_features = check_int(context_features, "context_features", 1)
        self.max_log_scale = check_float(max_log_scale, "max_log_scale", 0.0)
        self.context_net = ContextShift(context_features, 2 * features, hidden)

    def _check_options(self, inputs: Tensor, context: Tensor | None, logdet: object) -> None:
        if context is None:
            raise ValueError(
                f"ConditionalAffine needs context of shape (B, {self.context_features})"
            )
        check_context(context, inputs.shape[0], self.context_features, inputs)

    def _scale_shift(self, context: Tensor, inputs: Tensor) -> tuple[Tensor, Tensor]:
        raw, shift = self.context_net(context).chunk(2, dim=-1)
        log_scale = self.max_log_scale * torch.tanh(raw / self.max_log_scale)
        if inputs.dim() == 3:
            return log_scale.unsqueeze(1), shift.unsqueeze(1)
        return log_scale, shift

    def _per_token(self, log_scale: Tensor, inputs: Tensor) -> Tensor:
        """The log-determinant of every token's block, ``(B, N)`` (``(B, 1)`` for vectors):
        the sequence's own scale at every frame."""
        frames = 1 if inputs.dim() == 2 else inputs.shape[1]
        return log_scale.reshape(inputs.shape[0], -1).sum(-1)[:, None].expand(-1, frames)

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        log_scale, shift = self._scale_shift(context, inputs)
        return tokenwise_result(inputs, inputs * log_scale.exp() + shift, mask,
                                self._per_token(log_scale, inputs), logdet)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        log_scale, shift = self._scale_shift(context, inputs)
        return tokenwise_result(inputs, (inputs - shift) * (-log_scale).exp(), mask,
                                -self._per_token(log_scale, inputs), logdet)

    def extra_repr(self) -> str:
        return (f"features={self.features}, context_features={self.context_features}, "
                f"max_log_scale={self.max_log_scale}")
