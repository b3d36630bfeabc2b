"""make_logdet: building a log-determinant estimator from its name."""

from __future__ import annotations

import pytest

from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.factory import make_logdet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.logdet.series import SeriesLogDet


def test_make_logdet():
    assert isinstance(make_logdet("exact"), ExactLogDet)
    series = make_logdet("series", n_terms=4, probe="gaussian")
    assert isinstance(series, SeriesLogDet) and series.n_terms == 4 and series.probe == "gaussian"
    roulette = make_logdet("roulette", distribution="poisson", lam=3.0)
    assert isinstance(roulette, RouletteLogDet) and roulette.lam == 3.0
    instance = RouletteLogDet()
    assert make_logdet(instance) is instance
    assert isinstance(instance, LogDetEstimator)
    with pytest.raises(ValueError, match="method must be one of"):
        make_logdet("brute")
    with pytest.raises(ValueError, match="cannot be combined"):
        make_logdet(instance, n_probes=2)
    with pytest.raises(TypeError, match="method"):
        make_logdet(3)
