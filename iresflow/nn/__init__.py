"""Lipschitz building blocks: normalised linear maps, LipSwish, MLP and attention branches."""

from iresflow.nn.activations import LipSwish
from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    ContractiveLipschitzNormAttention,
    DotProductMultiheadAttention,
    L2MultiheadAttention,
    lipschitz_bound,
)
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.bounds import l2_attention_bound, phi_inv
from iresflow.nn.causal import CausalTransformer
from iresflow.nn.conv import SpectralConv1d, TemporalConvBranch, circular_conv_norm
from iresflow.nn.diagnostics import attention_weights, empirical_lipschitz, jacobian_norm
from iresflow.nn.linear import InfNormLinear, SpectralLinear
from iresflow.nn.lipschitz_norm import LinearScoreAttention
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.relative import RelativeMixingBranch

__all__ = [
    "CausalTransformer",
    "ContractiveL2MultiheadAttention",
    "ContractiveLipschitzNormAttention",
    "DotProductMultiheadAttention",
    "InfNormLinear",
    "L2MultiheadAttention",
    "LinearScoreAttention",
    "LipSwish",
    "LipschitzBranch",
    "LipschitzMLP",
    "RelativeMixingBranch",
    "SpectralConv1d",
    "SpectralLinear",
    "TemporalConvBranch",
    "attention_weights",
    "circular_conv_norm",
    "empirical_lipschitz",
    "jacobian_norm",
    "l2_attention_bound",
    "lipschitz_bound",
    "phi_inv",
]
