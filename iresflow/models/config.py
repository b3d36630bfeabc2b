"""The model's settings: one record, the single source of every model default.

:class:`ModelConfig` is what :class:`~iresflow.models.residual_flow.ResidualSequenceFlow` is
built from, what the training configuration embeds (as its field ``model``), what the command
line turns into flags and what a checkpoint stores. Every check of a model setting lives in
:meth:`ModelConfig.check`.
"""

from __future__ import annotations

from dataclasses import dataclass

from iresflow._settings import ConfigError, SettingsRecord, check_minimum, check_range, setting
from iresflow.models.distributions import BASES
from iresflow.models.registry import LAYERS

__all__ = ["DEFAULT_AR_ORDER", "LAYER_KINDS", "MAX_AUTO_AR_ORDER", "ModelConfig", "default_heads"]

#: Layer kinds of a block recipe (:attr:`ModelConfig.layers`), read from the registry at every use:
#: residual steps of a registered branch kind (built in: contractive attention, relative mixing,
#: temporal convolution, position-wise MLP; :mod:`iresflow.models.branches`), or ``"mix"``, an LU
#: feature mixing.
LAYER_KINDS = LAYERS.choices


#: The order of the autoregressive input layer of a model built without data.
DEFAULT_AR_ORDER = 3
#: The highest order an automatic ``ar_order`` chooses from the validation evidence.
MAX_AUTO_AR_ORDER = 3


def default_heads(features: int) -> int:
    """Default number of attention heads: the largest of 4, 3, 2, 1 that divides ``features``.

    Four heads of width ``D / 4`` is the usual choice for small feature sizes (``D = 12`` gives
    head width 3); smaller ``D`` fall back to the largest divisor available.

    Args:
        features: Feature size ``D``.

    Returns:
        The number of heads.

    Example:
        >>> default_heads(12), default_heads(6), default_heads(5)
        (4, 3, 1)
    """
    return next(h for h in (4, 3, 2, 1) if features % h == 0)


@dataclass(frozen=True)
class ModelConfig(SettingsRecord):
    """Every setting of a residual sequence flow, validated on construction.

    ``features`` and ``max_len`` describe the data; they may be left ``None`` while the data is
    not known yet (the training configuration fills them from the dataset), but a model can only
    be built from a config that has both.

    Raises:
        ConfigError: a value has the wrong type or lies outside its range (a ``ValueError``).

    Example:
        >>> config = ModelConfig(features=12, max_len=29, n_blocks=2)
        >>> config.replace(hidden=8).hidden, ModelConfig.from_dict(config.to_dict()) == config
        (8, True)
    """

    features: int | None = setting(None, "feature size D of every frame", unset="from the data")
    max_len: int | None = setting(
        None, "longest sequence the model accepts", unset="the data's longest sequence"
    )
    ar_order: int | None = setting(
        None, "order p of the autoregressive linear layer over frames at the data end, fitted "
        "by least squares at initialisation (0: none)",
        unset=f"the order 0..{MAX_AUTO_AR_ORDER} whose input layers, fitted on the training "
        f"split, score best on the validation split, decided when training starts (a model "
        f"built without data: {DEFAULT_AR_ORDER})",
    )
    position_norm: str = setting(
        "auto", "a shift and scale of their own for every position at the data end, for data "
        "whose law depends on the position (daily profiles, image rows); auto: on when it "
        "improves the closed-form AR(p) Gaussian on the validation sequences by a one-sided "
        "signed-rank test at the 5% level (decided when training starts; a model built "
        "without data: off)",
        ("auto", "on", "off"),
    )
    volatility: int = setting(
        0, "order q of a volatility step after the autoregressive layer at the data end: every "
        "frame divided by a scale that follows the squares of the q frames before it, so bursts "
        "and pauses within a recording get scales of their own (0: none; "
        "docs/math.md#volatility-step)"
    )
    n_blocks: int = setting(3, "number of blocks")
    layers: tuple[str, ...] = setting(
        ("conv", "mlp"),
        "layers of every block, in order: attention, relative (an MLP of a learned average "
        "over relative offsets), conv (temporal convolution) and mlp are residual steps after "
        "an ActNorm; mix is an LU feature mixing; autoregressive an affine step conditioned on "
        "the past frames by a causal Transformer or a GRU (conditioner); maf an autoregressive "
        "step whose feature d also reads the frame's features before d (a MAF over the "
        "features given the past)",
        LAYER_KINDS,
    )
    conditioner: str = setting(
        "transformer", "network that computes the shift and scale of the autoregressive (and "
        "maf) layers from the past frames: transformer (causal attention over all of them) or "
        "gru (a recurrent state, one cheap update per frame when sampling)", ("transformer", "gru"),
    )
    hidden: int = setting(64, "hidden width of the feed-forward and convolution branches, and of "
                          "the conditioners of autoregressive and maf layers")
    kernel_size: int = setting(3, "odd kernel size of the temporal convolutions")
    dilation: int = setting(
        1, "growth of the dilation of the conv layers from block to block: block i reads frames "
        "dilation^i apart, starting again at 1 once that would reach past the longest sequence "
        "(1: none; 2: 1, 2, 4, ...; docs/math.md#temporal-conv)"
    )
    causal: bool = setting(
        False, "make every layer causal over frames, so noise frame t depends on data frames "
        "<= t only: conv, attention and relative layers read the current and past frames "
        "(attention: with attention = l2 only), mlp, mix, autoregressive and maf layers are kept "
        "as they are (docs/math.md#causal-attention)"
    )
    heads: int | None = setting(
        None, "attention heads, dividing the number of features",
        unset="the largest of 4, 3, 2, 1 that divides it",
    )
    coeff: float = setting(0.9, "Lipschitz coefficient of every residual branch, in (0, 1)")
    attention: str = setting(
        "l2", "kind of the attention layers: l2 (contractive L2 attention) or lipschitznorm",
        ("l2", "lipschitznorm"),
    )
    positional: str = setting("sinusoidal", "positional encoding", ("sinusoidal", "learned"))
    relative_window: int | None = setting(
        None, "window W of a learned relative-position bias in the scores of l2 attention "
        "(offsets clipped to [-W, W]; the certificate includes it), and of the relative layers",
        unset="no bias; relative layers: the longest sequence minus one",
    )
    logdet: str = setting(
        "roulette", "log-determinant used for training: roulette (unbiased, with the Neumann "
        "gradient), exact, or series (truncated power series, biased)",
        ("exact", "roulette", "series"),
    )
    n_power_iterations: int = setting(
        1, "power iterations per step for spectral normalisation (with spectral_norm power)"
    )
    spectral_norm: str = setting(
        "exact", "spectral norm of the MLP layers in training: exact (one SVD per weight "
        "update; the certificate holds in every forward) or power (power iteration, cheaper for "
        "wide layers, but it can lag the weights)", ("exact", "power")
    )
    base: str = setting(
        "sequence-t", "density of the noise: standard normal, Student-t per feature with "
        "learned degrees of freedom, one multivariate t per frame, or one multivariate t over "
        "the real frames of a sequence (heavy tails; sequence-t: every sequence a Gaussian with "
        "a random scale of its own, so quiet and loud recordings are both likely)", BASES.choices
    )
    context_features: int = setting(
        0, "size C of the per-sequence context vector: covariates, or the class-label embedding "
        "(0: unconditional, or 8 with num_classes)"
    )
    num_classes: int = setting(
        0, "number of class labels the flow is conditioned on (0: none; covariates if "
        "context_features > 0)"
    )

    def check(self) -> None:
        check_range("coeff", self.coeff, 0.0, 1.0)
        if self.volatility < 0:
            raise ConfigError(f"volatility must be >= 0 (0: none), got {self.volatility}")
        check_minimum(self, ("features", "max_len", "n_blocks", "hidden", "heads",
                             "n_power_iterations", "kernel_size", "relative_window", "dilation"),
                      1)
        for name in ("context_features", "num_classes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: none), got {getattr(self, name)}")
        if self.ar_order is not None and self.ar_order < 0:
            raise ConfigError(f"ar_order must be >= 0 (0: no autoregressive layer), got "
                              f"{self.ar_order}")
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size must be odd, got {self.kernel_size}")
        if not self.layers:
            raise ConfigError("layers must name at least one layer kind")
        if (self.relative_window is not None and "attention" in self.layers
                and self.attention != "l2"):
            raise ConfigError(
                f"relative_window needs attention = l2, got attention = {self.attention}"
            )
        if self.features is not None and self.heads is not None and self.features % self.heads:
            raise ConfigError(
                f"heads must divide features={self.features}, got heads={self.heads}"
            )

    @property
    def resolved_heads(self) -> int:
        """``heads``, or :func:`default_heads` of ``features`` when left automatic."""
        if self.features is None:
            raise ConfigError("features must be set to resolve the number of heads")
        return default_heads(self.features) if self.heads is None else self.heads

    def block_dilation(self, block: int) -> int:
        r"""The dilation of the conv layers of block ``block`` (0 nearest the data).

        With growth :math:`g` = ``dilation`` and kernel size :math:`k`, block :math:`i` reads
        frames :math:`g^{i \bmod C}` apart, where :math:`C` counts the powers :math:`g^j` whose
        reach :math:`g^j (k - 1)` stays below ``max_len`` (at least one): the cycle restarts
        before a dilation would read nothing but padding.

        Example:
            >>> config = ModelConfig(features=2, max_len=20, dilation=2)
            >>> tuple(config.block_dilation(i) for i in range(6))
            (1, 2, 4, 8, 1, 2)
        """
        growth = self.dilation
        if growth == 1 or self.kernel_size == 1:
            return 1
        if self.max_len is None:
            raise ConfigError("max_len must be set to resolve the dilation of a block")
        cycle = 1
        while growth**cycle * (self.kernel_size - 1) < self.max_len:
            cycle += 1
        return growth ** (block % cycle)

    @property
    def resolved_ar_order(self) -> int:
        """``ar_order``, or :data:`DEFAULT_AR_ORDER` when left to the data: the order of a model
        built without data (training decides it first, in
        :func:`~iresflow.train.factories.resolve_model_config`)."""
        return DEFAULT_AR_ORDER if self.ar_order is None else self.ar_order

    @property
    def conditional(self) -> bool:
        """Whether the model is conditional (``context_features`` or ``num_classes`` set)."""
        return self.context_features > 0 or self.num_classes > 0

    @property
    def resolved_context_features(self) -> int:
        """Context size ``C``: ``context_features``, or 8 for labels left automatic (0 when
        unconditional)."""
        if self.context_features == 0 and self.num_classes > 0:
            return 8
        return self.context_features
