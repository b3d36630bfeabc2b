"""Ready-made flows: the generic masked sequence flow and the residual-flow Transformer."""

from iresflow.models.config import ModelConfig
from iresflow.models.distributions import StandardNormalSequence
from iresflow.models.flow import SequenceFlow
from iresflow.models.transformer import ResidualFlowTransformer

__all__ = ["ModelConfig", "ResidualFlowTransformer", "SequenceFlow", "StandardNormalSequence"]
