"""Fixed-point inversion of residual blocks (plain iteration and Anderson acceleration) and of
causal maps whose frames settle in order."""

from iresflow.inverse.causal import causal_fixed_point_inverse
from iresflow.inverse.fixed_point import (
    InverseStats,
    InversionError,
    InversionWarning,
    fixed_point_inverse,
)

__all__ = [
    "InverseStats",
    "InversionError",
    "InversionWarning",
    "causal_fixed_point_inverse",
    "fixed_point_inverse",
]
