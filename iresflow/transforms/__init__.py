"""Invertible transforms (nflows ``Transform`` subclasses with padding-mask support)."""

from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.base import SequenceCompositeTransform, SequenceTransform
from iresflow.transforms.residual import ResidualTransform

__all__ = ["ActNorm", "ResidualTransform", "SequenceCompositeTransform", "SequenceTransform"]
