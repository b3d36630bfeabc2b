"""Flows: the generic sequence flow (a chain and a base) and the residual-flow Transformer."""

from iresflow.models.config import ModelConfig
from iresflow.models.distributions import (
    SequenceBase,
    StandardNormalSequence,
    StudentTSequence,
)
from iresflow.models.flow import SequenceFlow
from iresflow.models.transformer import ResidualFlowTransformer

__all__ = [
    "ModelConfig",
    "ResidualFlowTransformer",
    "SequenceBase",
    "SequenceFlow",
    "StandardNormalSequence",
    "StudentTSequence",
]
