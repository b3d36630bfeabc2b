"""Ready-made flows: the sequence residual-flow Transformer."""

from iresflow.models.transformer import ResidualFlowTransformer

__all__ = ["ResidualFlowTransformer"]
