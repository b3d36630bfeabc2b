"""Flows: the generic sequence flow (a chain and a base) and the residual sequence flow built from
a block recipe."""

from iresflow.models.config import ModelConfig
from iresflow.models.distributions import (
    SequenceBase,
    StandardNormalSequence,
    StudentTSequence,
)
from iresflow.models.flow import SequenceFlow
from iresflow.models.residual_flow import ResidualSequenceFlow

__all__ = [
    "ModelConfig",
    "ResidualSequenceFlow",
    "SequenceBase",
    "SequenceFlow",
    "StandardNormalSequence",
    "StudentTSequence",
]


def __getattr__(name: str) -> object:
    # The model was called ResidualFlowTransformer before its default recipe (no attention)
    # made the name misleading; the old name still works, with a warning.
    if name == "ResidualFlowTransformer":
        import warnings

        warnings.warn("ResidualFlowTransformer is now ResidualSequenceFlow; the old name will be "
                      "removed", DeprecationWarning, stacklevel=2)
        return ResidualSequenceFlow
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
