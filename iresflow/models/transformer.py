r"""The sequence residual-flow Transformer (docs/math.md#contractive-attention).

Every block is a composition of invertible maps (data to noise)

.. math::
    X \;\to\; \mathrm{ActNorm} \;\to\; (\cdot) + f_{\rm attn}(\cdot + E)
      \;\to\; \mathrm{ActNorm} \;\to\; (\cdot) + f_{\rm ffn}(\cdot),

with a contractive attention branch :math:`f_{\rm attn}` (L2 attention certified in the
:math:`\infty`-norm, MATH.md C, D; or LipschitzNorm attention certified in the 2-norm, MATH.md F)
that sees a positional table :math:`E` added inside the branch, and a
position-wise spectrally normalised LipSwish MLP :math:`f_{\rm ffn}` (MATH.md G6, G7). The noise
:math:`Z` has a standard normal density over the real tokens, so by the change of variables
(MATH.md G1)

.. math:: \log p(X) = \sum_{n\,:\,m_n = 1} \log\mathcal N(z_n; 0, I_D)
    + \sum_{\text{steps}} \log|\det J_{\text{step}}| .
"""

from __future__ import annotations

from typing import Any

from torch import nn

from iresflow._settings import ConfigError
from iresflow.models.config import ModelConfig
from iresflow.models.flow import SequenceFlow
from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    ContractiveLipschitzNormAttention,
)
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.conv import TemporalConvBranch
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.positional import PositionalBranch, make_positional_encoding
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.base import SequenceCompositeTransform
from iresflow.transforms.residual import ResidualTransform
from iresflow.transforms.temporal import AutoregressiveLinear, FeatureMixing

__all__ = ["ResidualFlowTransformer"]

#: Linear layers of the position-wise MLP branch (dims ``(D, hidden, hidden, D)``).
MLP_LAYERS = 3


class ResidualFlowTransformer(SequenceFlow):
    r"""Residual-flow Transformer: a normalising flow for (variable-length) sequences.

    ``n_blocks`` blocks of ``ActNorm -> x + f_attn(x + E) -> ActNorm -> x + f_ffn(x)`` (module
    docstring), a standard normal base over the real frames. With ``attention="none"`` every
    block is ``ActNorm -> x + f_ffn(x)``: a flow on single frames applied i.i.d. to every frame
    (the ablation without interactions between frames).

    Branch certificates: the attention branch is ``coeff`` times the attention map divided by
    its certified bound (docs/math.md#contractive-attention, docs/math.md#lipschitznorm); each
    of the three spectrally normalised layers of the MLP branch gets ``coeff ** (1/3)``, so that
    the MLP branch is also certified at ``coeff`` (2-norm). Every residual step is therefore
    invertible with :math:`\mathrm{lip}(g) \le` ``coeff`` ``< 1``.

    The model is a :class:`~iresflow.models.flow.SequenceFlow` (``log_prob``, ``sample``,
    ``transform_to_noise``, ``inverse``, ``initialize``, ``set_generator``, diagnostics); this
    class only builds its chain, :attr:`transform`, an nflows-compatible
    :class:`~iresflow.transforms.base.SequenceCompositeTransform` with named steps
    (``block0.actnorm_attention``, ``block0.attention``, ``block0.actnorm_mlp``,
    ``block0.mlp``, ...; usable inside ``nflows.flows.Flow`` for fixed-length data).

    Every setting, with its default, is a field of
    :class:`~iresflow.models.config.ModelConfig`; :attr:`config` holds the one the model was
    built from, so ``ResidualFlowTransformer(model.config)`` (or
    ``ResidualFlowTransformer(**model.config.to_dict())``) rebuilds the architecture for a
    saved ``state_dict``.

    Spectral normalisation uses power-iteration estimates in training mode and exact norms in
    evaluation mode (:class:`~iresflow.nn.linear.SpectralLinear`), and ActNorm initialises from
    the first training forward (or :meth:`initialize`): evaluate, invert and sample in
    ``eval()`` mode.

    Args:
        config: The settings; ``None`` builds them from ``settings``.
        **settings: :class:`~iresflow.models.config.ModelConfig` fields overriding those of
            ``config``; ``features`` and ``max_len`` must be set one way or the other.

    Raises:
        TypeError: ``config`` is not a ``ModelConfig``.
        ConfigError: an unknown or invalid setting, or ``features``/``max_len`` missing (a
            ``ValueError``).

    Example:
        >>> import torch
        >>> model = ResidualFlowTransformer(features=3, n_blocks=1, hidden=8, max_len=6)
        >>> model = model.double().eval()
        >>> x = torch.randn(2, 5, 3, dtype=torch.float64)
        >>> mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        >>> model.log_prob(x, mask, method="exact").shape
        torch.Size([2])
        >>> torch.allclose(model.inverse(model.transform_to_noise(x, mask), mask), x, atol=1e-8)
        True
    """

    config: ModelConfig

    def __init__(self, config: ModelConfig | None = None, **settings: Any) -> None:
        if config is None:
            config = ModelConfig.from_dict(settings)
        elif isinstance(config, ModelConfig):
            config = config.replace(**settings)
        else:
            raise TypeError(f"config must be a ModelConfig or None, got {type(config).__name__}")
        for name in ("features", "max_len"):
            if getattr(config, name) is None:
                raise ConfigError(f"{name} must be set to build a model")
        features = config.features
        encoding = None
        if "attention" in config.layers:
            encoding = make_positional_encoding(config.positional, features, config.max_len)
        steps: list[nn.Module] = []
        names: list[str] = []
        if config.ar_order > 0:
            steps += [ActNorm(features), AutoregressiveLinear(features, config.ar_order)]
            names += ["input.actnorm", "input.autoregressive"]
        for i in range(config.n_blocks):
            for j, kind in enumerate(config.layers):
                name = f"block{i}.{kind}" if config.layers.count(kind) == 1 else f"block{i}.{kind}{j}"
                if kind == "mix":
                    steps.append(FeatureMixing(features))
                    names.append(name)
                    continue
                branch = _branch(kind, config, encoding)
                steps += [ActNorm(features), ResidualTransform(branch, logdet=config.logdet)]
                names += [f"{name}.actnorm", name]
        super().__init__(SequenceCompositeTransform(steps, names), features=features,
                         max_len=config.max_len)
        self.config = config


def _branch(kind: str, config: ModelConfig, encoding: nn.Module | None) -> LipschitzBranch:
    """The contractive branch of a residual step of kind ``attention``, ``conv`` or ``mlp``."""
    features, hidden, coeff = config.features, config.hidden, config.coeff
    if kind == "attention":
        attention = _attention_branch(config.attention, features, config.resolved_heads, coeff)
        return PositionalBranch(attention, encoding)
    if kind == "conv":
        return TemporalConvBranch(features, hidden, config.kernel_size, coeff,
                                  max_len=config.max_len)
    return LipschitzMLP((features, hidden, hidden, features), coeff=coeff ** (1.0 / MLP_LAYERS),
                        n_power_iterations=config.n_power_iterations, sigma=config.spectral_norm)


def _attention_branch(kind: str, features: int, heads: int, coeff: float) -> LipschitzBranch:
    if kind == "l2":
        return ContractiveL2MultiheadAttention(features, heads, coeff=coeff)
    return ContractiveLipschitzNormAttention(features, heads, coeff=coeff)
