r"""The log-determinant engine interface (MATH.md G1).

Every residual block :math:`F(x) = x + g(x)` of iresflow obtains its log-Jacobian-determinant

.. math:: \log\det(I + J_g(x)) = \sum_{k \ge 1} \frac{(-1)^{k+1}}{k} \operatorname{tr}(J_g(x)^k)

from a :class:`LogDetEstimator`: exactly (:class:`~iresflow.logdet.exact.ExactLogDet`), by a
truncated power series (:class:`~iresflow.logdet.series.SeriesLogDet`) or by the unbiased Russian
roulette estimator (:class:`~iresflow.logdet.roulette.RouletteLogDet`). :func:`make_logdet` builds
one from its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from iresflow._validation import check_mask, check_sequence
from iresflow.nn.base import LipschitzBranch

__all__ = ["LogDetEstimator", "make_logdet"]

_DTYPES = (torch.float32, torch.float64)


class LogDetEstimator(ABC):
    r"""Computes :math:`g(x)` and :math:`\log\det(I + J_g(x))` for a residual branch :math:`g`.

    Calling an estimator validates its inputs (:mod:`iresflow._validation`) and returns the branch
    output together with the log-determinant of :math:`x \mapsto x + g(x)`, carrying an autograd
    graph suitable for training. Padded positions (``mask`` ``False``) never enter the
    log-determinant: the branch Jacobian has zero rows and columns there, so
    :math:`\det(I + J_g)` equals the determinant of the real sub-block.

    Estimators are plain callables (not modules); the branch's ``training`` flag selects
    training or evaluation behaviour where an estimator distinguishes them.
    """

    def __call__(
        self, branch: LipschitzBranch, x: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Evaluate the branch and the log-determinant of the residual map.

        Args:
            branch: The residual branch :math:`g`, a :class:`~iresflow.nn.base.LipschitzBranch`.
            x: Sequences, shape ``(B, N, D)``, dtype ``float32`` or ``float64``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            ``(g(x), logdet)`` with shapes ``(B, N, D)`` and ``(B,)``, in ``x``'s dtype and on
            ``x``'s device.

        Raises:
            TypeError: ``branch`` is not a ``LipschitzBranch``, ``x``/``mask`` have a wrong
                dtype, or ``x`` is not on the device/dtype of the branch parameters.
            ValueError: wrong shapes or non-finite values.
        """
        if not isinstance(branch, LipschitzBranch):
            raise TypeError(f"branch must be a LipschitzBranch, got {type(branch).__name__}")
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype not in _DTYPES:
            raise TypeError(f"x must have dtype torch.float32 or torch.float64, got {x.dtype}")
        # Checked here, on the caller's batch, rather than inside the branch on the repeated
        # batches the engines build (whose shapes would appear in the message).
        features = getattr(branch, "features", None)
        like = next(branch.parameters(), None)
        x = check_sequence(x, "x", features=features, allow_2d=False, like=like)
        mask = check_mask(mask, x)
        return self._estimate(branch, x, mask)

    @abstractmethod
    def _estimate(
        self, branch: LipschitzBranch, x: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Compute ``(g(x), logdet)`` for validated inputs (see :meth:`__call__`)."""


def make_logdet(method: str | LogDetEstimator, **kwargs: object) -> LogDetEstimator:
    r"""Build a log-determinant estimator from its name.

    Args:
        method: ``"exact"`` (:class:`~iresflow.logdet.exact.ExactLogDet`), ``"series"``
            (:class:`~iresflow.logdet.series.SeriesLogDet`), ``"roulette"``
            (:class:`~iresflow.logdet.roulette.RouletteLogDet`), or an estimator instance,
            returned unchanged.
        kwargs: Constructor arguments of the named estimator.

    Returns:
        The estimator.

    Raises:
        ValueError: unknown name, or keyword arguments given together with an instance.
        TypeError: ``method`` is neither a string nor an estimator.

    Example:
        >>> make_logdet("series", n_terms=5).n_terms
        5
    """
    from iresflow.logdet.exact import ExactLogDet
    from iresflow.logdet.roulette import RouletteLogDet
    from iresflow.logdet.series import SeriesLogDet

    if isinstance(method, LogDetEstimator):
        if kwargs:
            raise ValueError(
                f"keyword arguments {sorted(kwargs)} cannot be combined with an estimator instance"
            )
        return method
    if not isinstance(method, str):
        raise TypeError(
            f"method must be a string or a LogDetEstimator, got {type(method).__name__}"
        )
    estimators: dict[str, type[LogDetEstimator]] = {
        "exact": ExactLogDet,
        "series": SeriesLogDet,
        "roulette": RouletteLogDet,
    }
    if method not in estimators:
        raise ValueError(f"method must be one of {sorted(estimators)}, got {method!r}")
    return estimators[method](**kwargs)
