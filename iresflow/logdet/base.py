r"""The log-determinant engine interface (docs/math.md#change-of-variables).

Every residual block :math:`F(x) = x + g(x)` of iresflow obtains its log-Jacobian-determinant

.. math:: \log\det(I + J_g(x)) = \sum_{k \ge 1} \frac{(-1)^{k+1}}{k} \operatorname{tr}(J_g(x)^k)

from a :class:`LogDetEstimator`: exactly (:class:`~iresflow.logdet.exact.ExactLogDet`), by a
truncated power series (:class:`~iresflow.logdet.series.SeriesLogDet`) or by the unbiased Russian
roulette estimator (:class:`~iresflow.logdet.roulette.RouletteLogDet`).
:func:`~iresflow.logdet.factory.make_logdet` builds one from its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor

from iresflow._validation import check_inputs, check_logdet_dtype, value_checks
from iresflow.nn.base import LipschitzBranch

__all__ = ["LogDetEstimator"]


class LogDetEstimator(ABC):
    r"""Computes :math:`g(x)` and :math:`\log\det(I + J_g(x))` for a residual branch :math:`g`.

    Calling an estimator validates its inputs (:mod:`iresflow._validation`) and returns the branch
    output together with the log-determinant of :math:`x \mapsto x + g(x)`, carrying an autograd
    graph suitable for training. :meth:`estimate` is the same computation without the checks,
    for callers that validated the batch already (the residual transforms); subclasses
    implement it. Padded positions (``mask`` ``False``) never enter the
    log-determinant: the branch Jacobian has zero rows and columns there, so
    :math:`\det(I + J_g)` equals the determinant of the real sub-block.

    Estimators are plain callables (not modules); the branch's ``training`` flag selects
    training or evaluation behaviour where an estimator distinguishes them. An engine may
    evaluate the branch on the batch repeated along the rows (:func:`repeat_rows`: row ``r``
    holds sequence ``r mod B``), e.g. one copy per Hutchinson probe.
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
            ValueError: wrong shapes, non-finite values, or ``N`` beyond the branch's
                ``max_len`` (where its certificate no longer holds).
        """
        if not isinstance(branch, LipschitzBranch):
            raise TypeError(f"branch must be a LipschitzBranch, got {type(branch).__name__}")
        if isinstance(x, Tensor) and x.is_floating_point():
            check_logdet_dtype(x, "x")
        # Checked here, on the caller's batch, rather than inside the branch on the repeated
        # batches the engines build (whose shapes would appear in the message).
        features = getattr(branch, "features", None)
        like = next(branch.parameters(), None)
        x, mask = check_inputs(x, mask, "x", features=features, allow_2d=False, like=like)
        branch.check_length(x.shape[1])
        with value_checks(False):
            return self.estimate(branch, x, mask)

    @abstractmethod
    def estimate(
        self, branch: LipschitzBranch, x: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Compute ``(g(x), logdet)`` for validated inputs (see :meth:`__call__`); no checks.

        Args:
            branch: The residual branch :math:`g`.
            x: Sequences ``(B, N, D)``, already validated by the caller.
            mask: Optional boolean padding mask ``(B, N)`` on ``x``'s device, or ``None``.

        Returns:
            ``(g(x), logdet)`` with shapes ``(B, N, D)`` and ``(B,)``.
        """
