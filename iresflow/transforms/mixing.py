r"""An invertible linear map of the features of every frame, in LU form
(docs/math.md#feature-mixing)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from iresflow._validation import check_generator, check_int
from iresflow.transforms.actnorm import tokenwise_result
from iresflow.transforms.base import LogDetRequest, SequenceTransform

__all__ = ["FeatureMixing"]


class FeatureMixing(SequenceTransform):
    r"""Invertible linear map of the features of every frame, LU-parameterised (Glow's 1x1 conv).

    For every real frame (docs/math.md#feature-mixing),

    .. math::
        y_t = W x_t, \qquad W = P L \big(U + \mathrm{diag}(s \odot e^{\ell})\big), \qquad
        \log|\det J| = n \sum_{d=1}^{D} \ell_d ,

    with a fixed permutation :math:`P` (buffer ``permutation``: row :math:`i` of :math:`W` is
    row ``permutation[i]`` of :math:`L U`), :math:`L` unit lower triangular (strictly lower part
    of ``lower``), :math:`U` strictly upper triangular (strictly upper part of ``upper``), fixed
    signs :math:`s \in \{\pm 1\}^D` (buffer ``sign``), log-magnitudes :math:`\ell`
    (``log_abs_diag``) and :math:`n` the number of real frames. The inverse is
    :math:`x_t = U_\ell^{-1} L^{-1} P^\top y_t` by two triangular solves. Padded frames are
    returned unchanged and add nothing to the log-determinant. :math:`W` starts as the LU
    factorisation of a random proper rotation (:math:`\det W = 1`). A ``(B, D)`` batch of vectors
    is treated as sequences of length 1.

    Args:
        features: Feature size ``D``.
        generator: Optional ``torch.Generator`` for the random initial rotation.

    Example:
        >>> mixing = FeatureMixing(3, generator=torch.Generator().manual_seed(0))
        >>> x = torch.randn(4, 5, 3)
        >>> y, logabsdet = mixing(x)
        >>> torch.allclose(logabsdet, torch.zeros(4), atol=1e-5)
        True
        >>> torch.allclose(mixing.inverse(y)[0], x, atol=1e-5)
        True
    """

    causal = True  # frame-wise

    permutation: Tensor
    sign: Tensor

    def __init__(self, features: int, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        generator = check_generator(generator)
        device = None if generator is None else generator.device
        rotation, _ = torch.linalg.qr(
            torch.randn(self.features, self.features, generator=generator, device=device)
        )
        # A proper rotation (det = +1): the layer starts orientation-preserving, like the
        # residual steps, so the Jacobian determinant of a whole flow stays positive.
        rotation[:, 0] *= torch.linalg.det(rotation).sign()
        permutation, lower, upper = torch.linalg.lu(rotation)
        diagonal = torch.diagonal(upper)
        # The permutation matrix has a single 1 per row: row i of P M is row argmax_j P[i, j].
        self.register_buffer("permutation", permutation.argmax(dim=1))
        self.register_buffer("sign", torch.sign(diagonal))
        self.lower = nn.Parameter(torch.tril(lower, -1))
        self.upper = nn.Parameter(torch.triu(upper, 1))
        self.log_abs_diag = nn.Parameter(torch.log(diagonal.abs()))

    def _factors(self) -> tuple[Tensor, Tensor]:
        """The unit lower and the upper triangular factor, each ``(D, D)``."""
        eye = torch.eye(self.features, dtype=self.lower.dtype, device=self.lower.device)
        lower = torch.tril(self.lower, -1) + eye
        diagonal = self.sign * torch.exp(self.log_abs_diag)
        upper = torch.triu(self.upper, 1) + torch.diag_embed(diagonal)
        return lower, upper

    def weight(self) -> Tensor:
        """The matrix :math:`W = P L U`, shape ``(D, D)``."""
        lower, upper = self._factors()
        return (lower @ upper)[self.permutation]

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map data to noise, :math:`y_t = W x_t` on real frames."""
        outputs = inputs @ self.weight().mT
        return tokenwise_result(inputs, outputs, mask, self.log_abs_diag.sum(), logdet)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map noise to data, :math:`x_t = U^{-1} L^{-1} P^\top y_t` on real frames."""
        lower, upper = self._factors()
        # P v = y  <=>  v[permutation] = y; then row-vector solves a^T L^T = v^T, x^T U^T = a^T.
        unpermuted = inputs[..., torch.argsort(self.permutation)]
        solved = torch.linalg.solve_triangular(
            lower.mT, unpermuted, upper=True, left=False, unitriangular=True
        )
        outputs = torch.linalg.solve_triangular(upper.mT, solved, upper=False, left=False)
        return tokenwise_result(inputs, outputs, mask, -self.log_abs_diag.sum(), logdet)

    def extra_repr(self) -> str:
        return f"features={self.features}"
