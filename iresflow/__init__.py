"""iresflow: invertible residual flows on sequences.

Subpackages: :mod:`iresflow.nn` (Lipschitz branches), :mod:`iresflow.transforms` (invertible
nflows transforms), :mod:`iresflow.logdet` (log-determinant engine), :mod:`iresflow.inverse`
(fixed-point inverse engine), :mod:`iresflow.models` (ready-made flows), :mod:`iresflow.data`
(offline datasets), :mod:`iresflow.train` (training, checkpoints, processes) and
:mod:`iresflow.runs` (using a finished run: loading, evaluation, samples, figures).
:func:`value_checks` switches the NaN/Inf and padding-mask value checks of every entry point
off for a block (see :mod:`iresflow._validation`); :func:`keep_freed_memory` lets the process
reuse freed memory (see :mod:`iresflow.heap`).
"""

from iresflow._validation import value_checks
from iresflow.data import load_dataset
from iresflow.heap import keep_freed_memory
from iresflow.inverse import InversionError, fixed_point_inverse
from iresflow.models import ModelConfig, ResidualSequenceFlow, SequenceFlow
from iresflow.transforms import ActNorm, ResidualTransform, SequenceCompositeTransform

__version__ = "0.1.0"

__all__ = [
    "ActNorm",
    "InversionError",
    "ModelConfig",
    "ResidualSequenceFlow",
    "ResidualTransform",
    "SequenceCompositeTransform",
    "SequenceFlow",
    "fixed_point_inverse",
    "keep_freed_memory",
    "load_dataset",
    "value_checks",
]
