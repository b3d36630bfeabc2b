"""Fixed-point inversion of residual blocks (plain iteration and Anderson acceleration)."""

from iresflow.inverse.fixed_point import (
    InverseStats,
    InversionError,
    InversionWarning,
    fixed_point_inverse,
)

__all__ = ["InverseStats", "InversionError", "InversionWarning", "fixed_point_inverse"]
