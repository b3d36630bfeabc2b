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
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.positional import PositionalBranch, make_positional_encoding
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.base import SequenceCompositeTransform
from iresflow.transforms.residual import ResidualTransform

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
        features, max_len, heads = config.features, config.max_len, config.resolved_heads
        encoding = None if config.attention == "none" else make_positional_encoding(
            config.positional, features, max_len
        )
        layer_coeff = config.coeff ** (1.0 / MLP_LAYERS)
        steps: list[nn.Module] = []
        names: list[str] = []
        for i in range(config.n_blocks):
            if encoding is not None:
                attn = _attention_branch(config.attention, features, heads, config.coeff)
                steps += [ActNorm(features),
                          ResidualTransform(PositionalBranch(attn, encoding),
                                            logdet=config.logdet)]
                names += [f"block{i}.actnorm_attention", f"block{i}.attention"]
            mlp = LipschitzMLP((features, config.hidden, config.hidden, features),
                               coeff=layer_coeff, n_power_iterations=config.n_power_iterations,
                               sigma=config.spectral_norm)
            steps += [ActNorm(features), ResidualTransform(mlp, logdet=config.logdet)]
            names += [f"block{i}.actnorm_mlp", f"block{i}.mlp"]
        super().__init__(SequenceCompositeTransform(steps, names), features=features,
                         max_len=max_len)
        self.config = config


def _attention_branch(kind: str, features: int, heads: int, coeff: float) -> LipschitzBranch:
    if kind == "l2":
        return ContractiveL2MultiheadAttention(features, heads, coeff=coeff)
    return ContractiveLipschitzNormAttention(features, heads, coeff=coeff)
