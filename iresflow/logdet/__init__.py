"""Log-determinants of residual blocks: exact, truncated series and unbiased Russian roulette."""

from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.exact import ExactLogDet, jacobian_blocks
from iresflow.logdet.factory import make_logdet
from iresflow.logdet.policy import LogDetPolicy, logdet_policy
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.logdet.series import SeriesLogDet

__all__ = [
    "ExactLogDet",
    "LogDetEstimator",
    "LogDetPolicy",
    "RouletteLogDet",
    "SeriesLogDet",
    "jacobian_blocks",
    "logdet_policy",
    "make_logdet",
]
