"""Building a log-determinant estimator from its name (:func:`make_logdet`)."""

from __future__ import annotations

from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.logdet.series import SeriesLogDet

__all__ = ["make_logdet"]


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
