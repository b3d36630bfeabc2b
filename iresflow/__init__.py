"""iresflow: invertible residual flows on sequences.

Subpackages: :mod:`iresflow.nn` (Lipschitz branches), :mod:`iresflow.transforms` (invertible
nflows transforms), :mod:`iresflow.logdet` (log-determinant engine), :mod:`iresflow.inverse`
(fixed-point inverse engine), :mod:`iresflow.models` (ready-made flows), :mod:`iresflow.data`
(offline datasets) and :mod:`iresflow.train` (training, checkpoints, evaluation).
"""

from iresflow.data import load_dataset
from iresflow.inverse import InversionError, fixed_point_inverse
from iresflow.models import ResidualFlowTransformer
from iresflow.transforms import ActNorm, ResidualTransform, SequenceCompositeTransform

__version__ = "0.1.0"

__all__ = [
    "ActNorm",
    "InversionError",
    "ResidualFlowTransformer",
    "ResidualTransform",
    "SequenceCompositeTransform",
    "fixed_point_inverse",
    "load_dataset",
]
