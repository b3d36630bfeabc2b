r"""1-Lipschitz activations for residual branches (docs/math.md#lipswish)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LIPSWISH_SCALE", "LipSwish", "lipswish_second"]

#: The normalisation :math:`1 / 1.1` of LipSwish.
LIPSWISH_SCALE = 1 / 1.1


class LipSwish(nn.Module):
    r"""Learnable Swish rescaled to be 1-Lipschitz (Residual Flows; docs/math.md#lipswish, check H15
    (docs/math.md#checks)).

    .. math:: \mathrm{LipSwish}(z) = \frac{z\,\sigma(\beta z)}{1.1},
        \qquad \beta = \mathrm{softplus}(\beta'),

    with the scalar :math:`\beta'` (``beta_raw``) learned, initialised to 0.5. Its derivative is
    :math:`h'(\beta z)/1.1` with :math:`h(t) = t\sigma(t)`, whose range is about
    :math:`[-0.0998, 1.09984]` for every :math:`\beta > 0`, so the Lipschitz constant is
    :math:`1.09984/1.1 \approx 0.99985 < 1` independently of :math:`\beta`. Unlike ELU or softplus,
    the slope approaches its maximum where the curvature is still non-zero, which keeps the
    log-determinant gradient alive.

    Example:
        >>> act = LipSwish()
        >>> act(torch.tensor([-1.0, 0.0, 2.0])).shape
        torch.Size([3])
    """

    def __init__(self) -> None:
        super().__init__()
        self.beta_raw = nn.Parameter(torch.tensor(0.5))

    @property
    def beta(self) -> Tensor:
        r"""The positive slope :math:`\beta = \mathrm{softplus}(\beta')` (0-dim tensor)."""
        return F.softplus(self.beta_raw)

    def forward(self, z: Tensor) -> Tensor:
        """Apply the activation elementwise.

        Args:
            z: Any floating-point tensor, shape ``(...)``.

        Returns:
            Tensor of the same shape and dtype as ``z``.
        """
        if torch.is_grad_enabled():
            return z * torch.sigmoid(self.beta * z) / 1.1
        # Without a graph, as one fresh tensor: z sigma(beta z) = silu(beta z) / beta.
        beta = self.beta
        return F.silu(z * beta, inplace=True).mul_(1 / (1.1 * beta))


def lipswish_second(beta: Tensor, z: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    r"""Second-order LipSwish factors at ``z``, given :math:`s = \sigma(\beta z)`.

    Args:
        beta: The slope :math:`\beta` (0-dim).
        z: Pre-activations, any shape.
        s: :math:`\sigma(\beta z)`, the shape of ``z``.

    Returns:
        :math:`q = s (1 - s)(2 + t (1 - 2 s)) / 1.1` with :math:`t = \beta z` (so that
        :math:`\phi'' = \beta q` and :math:`\partial\phi'/\partial\beta = z q`) and
        :math:`d = s (1 - s) / 1.1` (so that :math:`\partial\phi/\partial\beta = z^2 d`), both
        of the shape of ``z``.
    """
    d = torch.rsub(s, 1).mul_(s).mul_(LIPSWISH_SCALE)
    return (beta * z).mul_(torch.rsub(s, 1, alpha=2)).add_(2).mul_(d), d
