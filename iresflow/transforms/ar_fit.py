r"""The least-squares Gaussian fits that initialise the autoregressive layer
(:class:`~iresflow.transforms.temporal.AutoregressiveLinear`, docs/math.md#temporal-linear), with
their floors on the residual covariance (docs/math.md#ar-variance-floor).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "MIN_INIT_RESIDUAL_VARIANCE",
    "RELATIVE_RESIDUAL_VARIANCE_FLOOR",
    "conditional_gaussian_fit",
    "relative_floor",
    "whitening_of",
]

#: Eigenvalue floor of the residual covariance in the initialisation of
#: :class:`~iresflow.transforms.temporal.AutoregressiveLinear`: a numerical guard in the units
#: of the data, which the training loop standardises (docs/math.md#temporal-linear).
MIN_INIT_RESIDUAL_VARIANCE = 1e-6
#: Floor of a sub-model's residual variance, in every direction, as a fraction of the variance of
#: the pooled fit of the same order in that direction (docs/math.md#ar-variance-floor).
RELATIVE_RESIDUAL_VARIANCE_FLOOR = 1e-3


def conditional_gaussian_fit(targets: Tensor, regressors: Tensor) -> tuple[Tensor, Tensor]:
    r"""Maximum-likelihood Gaussian regression of ``targets`` on ``regressors``.

    Args:
        targets: ``(R, D)``.
        regressors: ``(R, Q)`` (a column of ones for the bias).

    Returns:
        ``(coefficients (Q, D), covariance (D, D))``: the minimum-norm least-squares solution and
        the mean outer product of its residuals.
    """
    coefficients = torch.linalg.pinv(regressors) @ targets
    residuals = targets - regressors @ coefficients
    return coefficients, residuals.mT @ residuals / len(targets)


def _floor_eigenvalues(covariance: Tensor) -> Tensor:
    """``(D, D)`` covariance with its eigenvalues raised to :data:`MIN_INIT_RESIDUAL_VARIANCE`."""
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    eigenvalues = eigenvalues.clamp_min(MIN_INIT_RESIDUAL_VARIANCE)
    return (eigenvectors * eigenvalues) @ eigenvectors.mT


def relative_floor(covariance: Tensor, reference: Tensor) -> Tensor:
    r"""Raise the variance of ``covariance`` in every direction to at least :math:`\rho` times
    that of ``reference`` (docs/math.md#ar-variance-floor).

    With :math:`R = C C^\top` (``reference``, eigenvalues floored first) and
    :math:`C^{-1} \Sigma C^{-\top} = U \Lambda U^\top`, the result is
    :math:`C U \max(\Lambda, \rho) U^\top C^\top`, :math:`\rho =`
    :data:`RELATIVE_RESIDUAL_VARIANCE_FLOOR`; ``covariance`` itself where no eigenvalue is below
    :math:`\rho`.

    Args:
        covariance: ``(D, D)`` residual covariance :math:`\Sigma` of a sub-model.
        reference: ``(D, D)`` residual covariance :math:`R` of the pooled fit of its order.

    Returns:
        ``(D, D)``.
    """
    cholesky = torch.linalg.cholesky(_floor_eigenvalues(reference))
    half = torch.linalg.solve_triangular(cholesky, covariance, upper=False)
    relative = torch.linalg.solve_triangular(cholesky, half.mT, upper=False)
    eigenvalues, eigenvectors = torch.linalg.eigh(relative)
    if bool(eigenvalues.min() >= RELATIVE_RESIDUAL_VARIANCE_FLOOR):  # initialisation: host sync
        return covariance
    floored = eigenvectors * eigenvalues.clamp_min(RELATIVE_RESIDUAL_VARIANCE_FLOOR)
    back = cholesky @ floored @ eigenvectors.mT @ cholesky.mT
    return (back + back.mT) / 2


def whitening_of(covariance: Tensor) -> Tensor:
    r"""``(D, D)`` :math:`L = C^{-1}` for the Cholesky factor :math:`C` of ``covariance`` ``(D, D)``
    with its eigenvalues floored at :data:`MIN_INIT_RESIDUAL_VARIANCE`."""
    cholesky = torch.linalg.cholesky(_floor_eigenvalues(covariance))
    eye = torch.eye(covariance.shape[0], dtype=covariance.dtype, device=covariance.device)
    return torch.linalg.solve_triangular(cholesky, eye, upper=False)
