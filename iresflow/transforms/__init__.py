"""Invertible transforms (nflows ``Transform`` subclasses with padding-mask support)."""

from iresflow.transforms.actnorm import ActNorm, DataInitializedTransform
from iresflow.transforms.autoregressive import AutoregressiveAffine
from iresflow.transforms.base import SequenceTransform
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.mixing import FeatureMixing
from iresflow.transforms.positionwise import PositionwiseAffine
from iresflow.transforms.residual import ResidualTransform
from iresflow.transforms.temporal import AutoregressiveLinear

__all__ = [
    "ActNorm",
    "AutoregressiveAffine",
    "AutoregressiveLinear",
    "DataInitializedTransform",
    "FeatureMixing",
    "PositionwiseAffine",
    "ResidualTransform",
    "SequenceCompositeTransform",
    "SequenceTransform",
]
