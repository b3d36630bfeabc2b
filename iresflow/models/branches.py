"""The built-in residual layer kinds of a block recipe, and the branch of a residual step.

Each built-in kind is a builder ``(config, encoding) -> LipschitzBranch`` registered in
:data:`~iresflow.models.registry.BRANCH_KINDS` (:func:`~iresflow.models.registry.register_branch`):
``attention`` (contractive L2 or LipschitzNorm self-attention with the positional encoding added
inside, docs/math.md#contractive-attention), ``relative`` (relative mixing,
docs/math.md#relative-mixing), ``conv`` (temporal convolution, docs/math.md#temporal-conv) and
``mlp`` (position-wise spectrally normalised LipSwish MLP, docs/math.md#spectral-norm), each
certified at ``config.coeff``. :func:`build_branch` builds the branch of a step of any
registered kind, conditional on the context in a conditional model.
"""

from __future__ import annotations

from torch import nn

from iresflow.models.config import ModelConfig
from iresflow.models.registry import BRANCH_KINDS, register_branch
from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    ContractiveLipschitzNormAttention,
)
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.conditional import ConditionalBranch
from iresflow.nn.conv import TemporalConvBranch
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.positional import PositionalBranch
from iresflow.nn.relative import RelativeMixingBranch

__all__ = ["MLP_LAYERS", "build_branch", "needs_positional_encoding"]

#: Linear layers of the position-wise MLP branch (dims ``(D, hidden, hidden, D)``).
MLP_LAYERS = 3


def build_branch(kind: str, config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    """The contractive branch of a residual step of a registered kind.

    Args:
        kind: A name of :data:`~iresflow.models.registry.BRANCH_KINDS`.
        config: The model's settings.
        encoding: The model's positional encoding, passed to kinds that take one.

    Returns:
        The kind's branch, wrapped in a :class:`~iresflow.nn.conditional.ConditionalBranch` in
        a conditional model (its certificate in ``x`` holds for every context).

    Raises:
        KeyError: ``kind`` is not registered.
    """
    entry = BRANCH_KINDS[kind]
    branch = entry.build(config, encoding if entry.positional else None)
    if config.conditional:
        return ConditionalBranch(branch, config.resolved_context_features)
    return branch


def needs_positional_encoding(layers: tuple[str, ...]) -> bool:
    """Whether a layer kind of the block recipe ``layers`` takes the positional encoding."""
    return any(BRANCH_KINDS[kind].positional for kind in layers if kind in BRANCH_KINDS)


def _attention(config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    heads = config.resolved_heads
    attention: LipschitzBranch
    if config.attention == "l2":
        attention = ContractiveL2MultiheadAttention(
            config.features, heads, coeff=config.coeff, max_offset=config.relative_window
        )
    else:
        attention = ContractiveLipschitzNormAttention(config.features, heads, coeff=config.coeff)
    return PositionalBranch(attention, encoding)  # type: ignore[arg-type]  # positional kind


def _relative(config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    window = config.relative_window or max(config.max_len - 1, 1)
    return RelativeMixingBranch(config.features, config.hidden, window, config.coeff)


def _conv(config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    return TemporalConvBranch(config.features, config.hidden, config.kernel_size, config.coeff,
                              max_len=config.max_len)


def _mlp(config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    return LipschitzMLP((config.features, config.hidden, config.hidden, config.features),
                        coeff=config.coeff ** (1.0 / MLP_LAYERS),
                        n_power_iterations=config.n_power_iterations,
                        sigma=config.spectral_norm)


register_branch("attention", _attention, "contractive self-attention (setting attention) with the "
                "positional encoding added inside the branch", positional=True)
register_branch("relative", _relative, "an MLP of a learned average over relative offsets")
register_branch("conv", _conv, "temporal convolution")
register_branch("mlp", _mlp, "position-wise MLP")
