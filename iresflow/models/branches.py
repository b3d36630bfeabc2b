"""The built-in layer kinds of a block recipe, and the steps a layer of any kind becomes.

Each built-in kind is a builder registered in :data:`~iresflow.models.registry.LAYERS`. The
residual kinds (:func:`~iresflow.models.registry.register_branch`) build a contractive branch,
certified at ``config.coeff``: ``attention`` (contractive L2 or LipschitzNorm self-attention with
the positional encoding added inside, docs/math.md#contractive-attention), ``relative`` (relative
mixing, docs/math.md#relative-mixing), ``conv`` (temporal convolution, docs/math.md#temporal-conv;
causal in a causal model, docs/math.md#causal-steps) and ``mlp`` (position-wise spectrally
normalised LipSwish MLP, docs/math.md#spectral-norm). The step kinds
(:func:`~iresflow.models.registry.register_step`) build an invertible step: ``mix`` (an LU
feature mixing, docs/math.md#feature-mixing) and ``autoregressive`` (an affine step conditioned
on the past frames by a causal Transformer, docs/math.md#autoregressive-step).
:func:`layer_steps` turns a layer of any registered kind into its named steps.
"""

from __future__ import annotations

from torch import nn

from iresflow._settings import ConfigError
from iresflow.models.config import ModelConfig, default_heads
from iresflow.models.registry import LAYERS, register_branch, register_step
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
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.autoregressive import AutoregressiveAffine
from iresflow.transforms.mixing import FeatureMixing
from iresflow.transforms.residual import ResidualTransform

__all__ = ["AUTOREGRESSIVE_DEPTH", "MAF_MAX_LOG_SCALE", "MLP_LAYERS", "layer_steps",
           "needs_positional_encoding"]

#: Linear layers of the position-wise MLP branch (dims ``(D, hidden, hidden, D)``).
MLP_LAYERS = 3

#: Layers of the conditioner of an ``autoregressive`` step: Transformer layers, GRU layers (one,
#: as in the GRU + MAF a user would otherwise build).
AUTOREGRESSIVE_DEPTH = {"transformer": 2, "gru": 1}

#: Bound on the log-scales of a ``maf`` step, tighter than an ``autoregressive`` step's 3: a
#: stack of steps that each scale a feature by up to e^3 given the frame's other features
#: turned the wider noise of a surprising past into forecasts thousands of times the data's
#: range (docs/small_data.md#maf-scale).
MAF_MAX_LOG_SCALE = 1.5


def layer_steps(
    kind: str, name: str, config: ModelConfig, encoding: nn.Module | None, block: int = 0
) -> list[tuple[str, nn.Module]]:
    """The named steps of one layer of a registered kind.

    A residual kind becomes ``ActNorm -> x + g(x)`` (steps ``name.actnorm`` and ``name``), its
    branch wrapped in a :class:`~iresflow.nn.conditional.ConditionalBranch` in a conditional
    model (the certificate in ``x`` holds for every context); a step kind is its one step
    ``name``. In a causal model (``config.causal``) the branch of a residual kind must be causal
    or position-wise (docs/math.md#causal-steps).

    Args:
        kind: A name of :data:`~iresflow.models.registry.LAYERS`.
        name: The layer's step name in the chain (``block0.conv``).
        config: The model's settings.
        encoding: The model's positional encoding, passed to kinds that take one.
        block: The index of the layer's block, passed to kinds that take it.

    Returns:
        ``(step name, step)`` pairs in chain order.

    Raises:
        KeyError: ``kind`` is not registered.
        ConfigError: ``config.causal`` and the kind builds a branch that reads later frames.
    """
    entry = LAYERS[kind]
    layer = entry.build(config, encoding if entry.positional else None,
                        **({"block": block} if entry.per_block else {}))
    if not entry.residual:
        return [(name, layer)]
    if config.causal and not (layer.causal or layer.position_wise):
        raise ConfigError(f"layer kind {kind!r} has no causal variant with these settings "
                          f"(attention: only attention = l2 has a certificate for a causal "
                          f"mask): with causal = true every layer must be causal over frames")
    if config.conditional:
        layer = ConditionalBranch(layer, config.resolved_context_features)
    return [(f"{name}.actnorm", ActNorm(config.features)),
            (name, ResidualTransform(layer, logdet=config.logdet))]


def needs_positional_encoding(layers: tuple[str, ...]) -> bool:
    """Whether a layer kind of the block recipe ``layers`` takes the positional encoding."""
    return any(LAYERS[kind].positional for kind in layers)


def _attention(config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    heads = config.resolved_heads
    attention: LipschitzBranch
    if config.attention == "l2":
        attention = ContractiveL2MultiheadAttention(
            config.features, heads, coeff=config.coeff, max_offset=config.relative_window,
            causal=config.causal,
        )
    else:
        attention = ContractiveLipschitzNormAttention(config.features, heads, coeff=config.coeff)
    return PositionalBranch(attention, encoding)  # type: ignore[arg-type]  # positional kind


def _relative(config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    window = config.relative_window or max(config.max_len - 1, 1)
    return RelativeMixingBranch(config.features, config.hidden, window, config.coeff,
                                causal=config.causal)


def _conv(config: ModelConfig, encoding: nn.Module | None, *, block: int) -> LipschitzBranch:
    return TemporalConvBranch(config.features, config.hidden, config.kernel_size, config.coeff,
                              max_len=config.max_len, causal=config.causal,
                              dilation=config.block_dilation(block))


def _mlp(config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    return LipschitzMLP((config.features, config.hidden, config.hidden, config.features),
                        coeff=config.coeff ** (1.0 / MLP_LAYERS),
                        n_power_iterations=config.n_power_iterations,
                        sigma=config.spectral_norm)


register_branch("attention", _attention, "contractive self-attention (setting attention) with the "
                "positional encoding added inside the branch", positional=True)
register_branch("relative", _relative, "an MLP of a learned average over relative offsets")
register_branch("conv", _conv, "temporal convolution (dilated by block: setting dilation)",
                per_block=True)
register_branch("mlp", _mlp, "position-wise MLP")


def _mix(config: ModelConfig, encoding: nn.Module | None) -> FeatureMixing:
    return FeatureMixing(config.features)


def _autoregressive(config: ModelConfig, encoding: nn.Module | None, *,
                    within_frame: bool = False, block: int = 0) -> AutoregressiveAffine:
    bound = {"max_log_scale": MAF_MAX_LOG_SCALE} if within_frame else {}
    return AutoregressiveAffine(
        config.features, width=config.hidden, depth=AUTOREGRESSIVE_DEPTH[config.conditioner],
        heads=default_heads(config.hidden), max_len=config.max_len, positional=config.positional,
        conditioner=config.conditioner,  # type: ignore[arg-type]  # a checked choice
        context_features=config.resolved_context_features, within_frame=within_frame,
        reverse_features=within_frame and block % 2 == 1, **bound,
    )


def _maf(config: ModelConfig, encoding: nn.Module | None, *, block: int) -> AutoregressiveAffine:
    return _autoregressive(config, encoding, within_frame=True, block=block)


register_step("mix", _mix, "an LU feature mixing")
register_step("autoregressive", _autoregressive,
              "an affine step whose shift and scale come from a causal Transformer or a GRU over "
              "the past frames (conditioner; width hidden, inverted by sweeps that settle the "
              "frames in order)")
register_step("maf", _maf,
              "an autoregressive step whose shift and scale of feature d also read the frame's "
              "features before d (a masked MLP after the conditioner: a MAF over the features "
              "given the past; the order reversed in every other block)", per_block=True)
