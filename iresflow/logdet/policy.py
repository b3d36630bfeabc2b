r"""The log-determinant method of a density evaluation (docs/math.md#change-of-variables).

A flow evaluates its density with a *method*: ``None`` (every residual step's configured
estimator), ``"exact"`` or ``"roulette"`` (docs/math.md#roulette). :func:`logdet_policy` turns
the method and the configured estimators of a chain's residual steps into a
:class:`LogDetPolicy`: which estimator every step uses, whether the result is deterministic,
and :meth:`LogDetPolicy.pass_request`, the ``logdet`` argument of one pass through the chain,
which hands every roulette step the count drawn for it (the counts of the whole pass in one
draw). :func:`set_generator` gives stochastic estimators one generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from iresflow._validation import check_generator
from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteCall, RouletteLogDet, draw_pass_counts

__all__ = ["METHODS", "LogDetPolicy", "logdet_policy", "set_generator"]

#: The log-determinant methods of a density evaluation.
METHODS = (None, "exact", "roulette")


@dataclass(frozen=True)
class LogDetPolicy:
    """The estimators of one density evaluation, one per residual step of a chain.

    Attributes:
        request: The ``logdet`` argument of the chain's call: ``True`` (every step's configured
            estimator) or the estimator every residual step uses instead.
        calls: The estimator of every residual step, in chain order.
        exact: Whether every log-determinant is exact, so that the density is deterministic.
    """

    request: bool | LogDetEstimator
    calls: tuple[LogDetEstimator, ...]
    exact: bool

    def pass_request(
        self, steps: Sequence[nn.Module]
    ) -> bool | LogDetEstimator | dict[nn.Module, LogDetEstimator]:
        """The ``logdet`` argument of one pass through the chain, with its random counts.

        Without a roulette estimator, :attr:`request` itself (nothing is drawn). Otherwise the
        roulette counts of every step of the pass are drawn at once
        (:func:`~iresflow.logdet.roulette.draw_pass_counts`: one host read per generator
        instead of one per step) and every step is mapped to its estimator for the pass: a
        :class:`~iresflow.logdet.roulette.RouletteCall` with its count for a roulette step,
        the estimator itself for the others.

        Args:
            steps: The residual steps of the chain, in the order of :attr:`calls`.

        Returns:
            ``True``, an estimator, or a dict from every step to its estimator of the pass.

        Example:
            >>> gen = torch.Generator().manual_seed(0)
            >>> policy = logdet_policy([RouletteLogDet(generator=gen), ExactLogDet()])
            >>> first, second = nn.Identity(), nn.Identity()
            >>> request = policy.pass_request([first, second])
            >>> type(request[first]).__name__, type(request[second]).__name__
            ('RouletteCall', 'ExactLogDet')
        """
        roulette = [estimator for estimator in self.calls if isinstance(estimator, RouletteLogDet)]
        if not roulette:
            return self.request
        counts = iter(draw_pass_counts(roulette))
        return {
            step: RouletteCall(estimator, next(counts))
            if isinstance(estimator, RouletteLogDet) else estimator
            for step, estimator in zip(steps, self.calls, strict=True)
        }


def logdet_policy(
    configured: Sequence[LogDetEstimator], method: str | None = None
) -> LogDetPolicy:
    """Choose the estimator of every residual step for a density evaluation.

    Args:
        configured: The configured estimator of every residual step, in chain order.
        method: ``None``: the configured estimators (exact when all of them are
            :class:`~iresflow.logdet.exact.ExactLogDet`); ``"exact"``: a dense-Jacobian
            :class:`~iresflow.logdet.exact.ExactLogDet` for every step; ``"roulette"``: the
            configured estimators, with their generators, when all of them are
            :class:`~iresflow.logdet.roulette.RouletteLogDet`, else one default
            ``RouletteLogDet`` on torch's global generator for every step.

    Returns:
        The policy.

    Raises:
        ValueError: an unknown method.

    Example:
        >>> policy = logdet_policy([ExactLogDet(), RouletteLogDet()], "roulette")
        >>> policy.exact, len(policy.calls), policy.calls[0] is policy.calls[1]
        (False, 2, True)
    """
    if method not in METHODS:
        raise ValueError(f"method must be None, 'exact' or 'roulette', got {method!r}")
    configured = tuple(configured)
    exact = method == "exact" or (
        method is None and bool(configured)
        and all(isinstance(estimator, ExactLogDet) for estimator in configured)
    )
    request: bool | LogDetEstimator = True
    if exact:
        request = ExactLogDet()
    elif method == "roulette" and not all(isinstance(e, RouletteLogDet) for e in configured):
        request = RouletteLogDet()
    calls = configured if request is True else (request,) * len(configured)
    return LogDetPolicy(request, calls, exact)


def set_generator(
    estimators: Sequence[LogDetEstimator], generator: torch.Generator | None
) -> None:
    """Make ``generator`` the generator of every stochastic estimator in ``estimators``.

    Args:
        estimators: Estimators; those without a ``generator`` (deterministic) are skipped.
        generator: A ``torch.Generator``, or ``None`` for torch's global one.

    Raises:
        TypeError: ``generator`` is neither a ``torch.Generator`` nor ``None``.

    Example:
        >>> estimator, gen = RouletteLogDet(), torch.Generator()
        >>> set_generator([estimator, ExactLogDet()], gen)
        >>> estimator.generator is gen
        True
    """
    generator = check_generator(generator)
    for estimator in estimators:
        if hasattr(estimator, "generator"):
            estimator.generator = generator
