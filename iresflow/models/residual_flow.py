r"""The sequence residual flow: an autoregressive input layer and blocks of certified layers.

The flow from data to noise is a chain of invertible maps (docs/math.md#change-of-variables),

.. math::
    X \;\to\; \mathrm{ActNorm} \;\to\; \mathrm{AR}(p) \;\to\;
    \underbrace{\big[\,\mathrm{ActNorm} \to (\cdot) + g_1(\cdot) \to \mathrm{ActNorm} \to
    (\cdot) + g_2(\cdot) \to \cdots\big]}_{\text{block, repeated } n_{\rm blocks}
    \text{ times}} \;\to\; Z,

with a learned autoregressive linear layer over frames
(:class:`~iresflow.transforms.temporal.AutoregressiveLinear`, docs/math.md#temporal-linear;
exact log-determinant, fitted by least squares at initialisation so that the flow starts as the
AR(p) Gaussian) and residual steps whose branches :math:`g` are contractive by construction:
temporal convolutions (docs/math.md#temporal-conv), contractive L2 or LipschitzNorm
self-attention with a positional table added inside the branch
(docs/math.md#contractive-attention, docs/math.md#lipschitznorm; L2 attention optionally with a
learned relative-position bias in its scores, docs/math.md#relative-bias) or position-wise
spectrally normalised LipSwish MLPs (docs/math.md#lipswish, docs/math.md#spectral-norm),
optionally with LU feature mixings (docs/math.md#feature-mixing). The noise :math:`Z` has a
standard normal density over the real frames (or a Student-t one,
docs/math.md#student-t-base), so

.. math:: \log p(X) = \sum_{n\,:\,m_n = 1} \log\mathcal N(z_n; 0, I_D)
    + \sum_{\text{steps}} \log|\det J_{\text{step}}| .
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from iresflow._settings import ConfigError
from iresflow._validation import check_int
from iresflow.models.branches import layer_steps, needs_positional_encoding
from iresflow.models.config import ModelConfig
from iresflow.models.distributions import StandardNormalSequence, make_base
from iresflow.models.flow import SequenceFlow
from iresflow.models.reference import MaskedSequences
from iresflow.nn.conditional import ContextEncoder
from iresflow.nn.positional import make_positional_encoding
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.conditional import ConditionalAffine
from iresflow.transforms.positionwise import PositionwiseAffine
from iresflow.transforms.temporal import AutoregressiveLinear
from iresflow.transforms.volatility import VolatilityScale

__all__ = ["ResidualSequenceFlow", "input_order_nll"]

class ResidualSequenceFlow(SequenceFlow):
    r"""Residual flow for (variable-length) sequences, built from a block recipe.

    An ``ActNorm`` and an autoregressive linear layer of order ``ar_order`` at the data end
    (none with ``ar_order = 0``; an automatic one, which training decides from the data, builds
    as ``3``; with ``position_norm = "on"`` a
    :class:`~iresflow.transforms.positionwise.PositionwiseAffine` comes first, in the
    ``ActNorm``'s place; ``"auto"``, which
    :func:`~iresflow.train.factories.resolve_model_config` decides from the data, builds as
    ``"off"``), then ``n_blocks`` blocks whose layers are ``config.layers`` in order (module
    docstring), kinds of :data:`~iresflow.models.registry.LAYERS`
    (:mod:`iresflow.models.branches`; more with :func:`~iresflow.models.registry.register_branch`
    and :func:`~iresflow.models.registry.register_step`): ``"conv"``, ``"attention"``,
    ``"relative"`` and ``"mlp"`` are residual steps ``ActNorm -> x + g(x)``, ``"mix"`` an LU
    feature mixing, ``"autoregressive"`` an affine step conditioned on the past frames by a
    causal Transformer (docs/math.md#autoregressive-step); the base over the real frames is
    the standard normal, or a Student-t with learned degrees of freedom, or any density of
    :data:`~iresflow.models.distributions.BASES` (``base``,
    :func:`~iresflow.models.distributions.make_base`). The default recipe (``ar_order`` automatic,
    blocks of ``conv`` and ``mlp``) contains the AR(p) Gaussian as a special case and starts
    from it. ``layers=("attention", "mlp")`` with ``ar_order=0`` is the residual-flow
    Transformer; ``layers=("mlp",)`` with ``ar_order=0`` a flow on single frames applied i.i.d.
    to every frame (the ablation without interactions between frames).

    Branch certificates: the attention branch is ``coeff`` times the attention map divided by
    its certified bound (docs/math.md#contractive-attention, docs/math.md#lipschitznorm); each
    of the three spectrally normalised layers of the MLP and convolution branches gets
    ``coeff ** (1/3)``, so that these branches are also certified at ``coeff`` (2-norm; the
    convolutions on the whole operator, docs/math.md#temporal-conv). Every residual step is
    therefore invertible with :math:`\mathrm{lip}(g) \le` ``coeff`` ``< 1``.

    The model is a :class:`~iresflow.models.flow.SequenceFlow` (``log_prob``, ``sample``,
    ``transform_to_noise``, ``inverse``, ``initialize``, ``set_generator``, diagnostics); this
    class only builds its chain, :attr:`transform`, an nflows-compatible
    :class:`~iresflow.transforms.composite.SequenceCompositeTransform` with named steps
    (``input.actnorm``, ``input.autoregressive``, ``block0.conv.actnorm``, ``block0.conv``,
    ``block0.mlp.actnorm``, ``block0.mlp``, ...; a kind repeated within a block is numbered by
    its position, ``block0.mlp0``, ``block0.mlp2``; usable inside ``nflows.flows.Flow`` for
    fixed-length data).

    Conditional flows :math:`p(x \mid c)`: with ``num_classes > 0`` (class labels through a
    learned embedding of size ``context_features``) or ``context_features > 0`` alone
    (covariates ``(B, C)``), the autoregressive input layer becomes conditional (its lags, bias
    and whitening shift with the context: a separate AR(p) Gaussian per class is within reach),
    every residual branch becomes a :class:`~iresflow.nn.conditional.ConditionalBranch` (a
    network of the context shifts the first layer of the ``conv`` and ``mlp`` branches and the
    input of ``attention``; the certificate in :math:`x` holds for every context,
    docs/math.md#conditional-branches), a
    :class:`~iresflow.transforms.conditional.ConditionalAffine` ends the chain (step
    ``output.affine``: a context-dependent diagonal Gaussian base), and every method takes
    ``context=`` (see :class:`~iresflow.models.flow.SequenceFlow`).

    Every setting, with its default, is a field of
    :class:`~iresflow.models.config.ModelConfig`; :attr:`config` holds the one the model was
    built from, so ``ResidualSequenceFlow(model.config)`` (or
    ``ResidualSequenceFlow(**model.config.to_dict())``) rebuilds the architecture for a
    saved ``state_dict``.

    The MLP layers normalise with exact spectral norms (``spectral_norm="exact"``, the default;
    ``"power"`` uses power-iteration estimates in training mode,
    :class:`~iresflow.nn.linear.SpectralLinear`), and ActNorm and the autoregressive layer
    initialise from the first training forward (or :meth:`initialize`, which the trainer calls
    on the leading training sequences): evaluate, invert and sample in ``eval()`` mode.

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
        >>> model = ResidualSequenceFlow(features=3, n_blocks=1, hidden=8, max_len=6)
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
        if needs_positional_encoding(config.layers):
            encoding = make_positional_encoding(config.positional, features, config.max_len)
        steps: list[nn.Module] = []
        names: list[str] = []
        for name, step in _input_steps(features, config.max_len, config.resolved_ar_order,
                                       config.position_norm == "on",
                                       config.resolved_context_features):
            steps.append(step)
            names.append(name)
        if config.volatility:
            steps.append(VolatilityScale(features, config.volatility))
            names.append("input.volatility")
        for i in range(config.n_blocks):
            for j, kind in enumerate(config.layers):
                repeated = config.layers.count(kind) > 1
                name = f"block{i}.{kind}{j}" if repeated else f"block{i}.{kind}"
                for step_name, step in layer_steps(kind, name, config, encoding, i):
                    steps.append(step)
                    names.append(step_name)
        encoder = None
        if config.conditional:
            encoder = ContextEncoder(config.resolved_context_features, config.num_classes)
            steps.append(ConditionalAffine(features, config.resolved_context_features))
            names.append("output.affine")
        super().__init__(SequenceCompositeTransform(steps, names), make_base(config.base, features),
                         features=features, max_len=config.max_len, context_encoder=encoder)
        self.config = config


def input_order_nll(
    train: MaskedSequences, val: MaskedSequences, max_order: int, *, position_norm: bool = False
) -> list[float]:
    r"""Validation NLL of the flow's input layers at their initial fit, for every AR order
    (docs/math.md#ar-order).

    For :math:`p = 0, \dots, P`, the data end of :class:`ResidualSequenceFlow` (an
    ``ActNorm``, or with ``position_norm`` a per-position affine, then an
    :class:`~iresflow.transforms.temporal.AutoregressiveLinear` of order :math:`p \ge 1`) is
    initialised on ``train`` as training initialises it (least squares; a sub-model without
    enough frames starts as the identity) and scored on ``val`` under a standard normal base:
    the density the flow starts from. An automatic ``ar_order`` takes the best order
    (:func:`~iresflow.train.factories.resolve_model_config`), so that the initial model is no
    worse on validation than any other order would make it; the closed-form AR(p) Gaussian of
    the reports has no identity fallback and prefers too low an order on little data.

    Args:
        train: Training split (``x`` ``(B, N, D)``, ``mask`` ``(B, N)``).
        val: Validation split (same ``N`` and ``D``) with at least one real frame.
        max_order: Highest order :math:`P \ge 0`.
        position_norm: Whether the flow standardises every position (``position_norm="on"``).

    Returns:
        The NLL (nats per real validation frame, model space) of every order ``0..P``.

    Example:
        >>> from iresflow.data.datasets import SequenceSplit
        >>> x = torch.randn(40, 8, 1, dtype=torch.float64).cumsum(1)  # a random walk: AR(1)
        >>> full, jac = torch.ones(20, 8, dtype=torch.bool), torch.zeros(20)
        >>> nll = input_order_nll(SequenceSplit(x[:20], full, jac),
        ...                       SequenceSplit(x[20:], full, jac), 3)
        >>> len(nll), nll[1] < nll[0]
        (4, True)
    """
    check_int(max_order, "max_order", 0)
    features, length = train.x.shape[2], train.x.shape[1]
    frames = float(val.mask.sum())
    if frames == 0:
        raise ValueError("val must hold at least one real frame to choose the order")
    base = StandardNormalSequence(features)
    nll = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", UserWarning)  # identity sub-models belong to the fit
        for order in range(max_order + 1):
            # Without input layers (order 0, no per-position map) the first block's ActNorm
            # standardises the frames: that is the density the flow starts from.
            steps = [step for _, step in _input_steps(features, length, order, position_norm)]
            chain = SequenceCompositeTransform(steps or [ActNorm(features)]).double()
            chain.initialize(train.x.double(), train.mask)
            z, logdet = chain(val.x.double(), mask=val.mask)
            nll.append(-float((base.log_prob(z, val.mask) + logdet).sum()) / frames)
    return nll


def _input_steps(
    features: int, max_len: int, order: int, position_norm: bool, context_features: int = 0,
) -> list[tuple[str, nn.Module]]:
    """The data end of the flow, named: the per-position map (``position_norm``) or, with an
    autoregressive layer, an ``ActNorm``; then the autoregressive layer of ``order >= 1``."""
    steps: list[tuple[str, nn.Module]] = []
    if position_norm:
        steps.append(("input.positionwise", PositionwiseAffine(features, max_len)))
    elif order > 0:
        steps.append(("input.actnorm", ActNorm(features)))
    if order > 0:
        steps.append(("input.autoregressive",
                      AutoregressiveLinear(features, order, context_features=context_features)))
    return steps
