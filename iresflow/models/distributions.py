r"""Base distributions of sequence flows and the padding masks of samples.

:class:`SequenceBase` is the contract of the density of a flow's noise over the real frames
(docs/math.md#masks; it lives in :mod:`iresflow.models.base_density` and is re-exported here
with :func:`sample_mask`); :class:`StandardNormalSequence` is the default base,
:class:`StudentTSequence` a heavy-tailed one with learned degrees of freedom
(docs/math.md#student-t-base). :data:`BASES` is the registry of the densities the model setting
``base`` names (:func:`register_base` adds one) and :func:`make_base` builds one by its name.
:func:`sample_mask` builds the padding mask of sequences to sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from iresflow._validation import check_float, check_generator, check_int
from iresflow.models.base_density import SequenceBase, sample_mask
from iresflow.models.gamma import sample_gamma
from iresflow.models.registry import Registry

__all__ = [
    "BASES",
    "BaseKind",
    "NU_INIT",
    "NU_MIN",
    "SequenceBase",
    "StandardNormalSequence",
    "StudentTSequence",
    "T_GROUPS",
    "make_base",
    "register_base",
    "sample_mask",
]

#: Groups of coordinates that share one chi-square scale in :class:`StudentTSequence`.
T_GROUPS = ("feature", "frame", "sequence")
#: Lower bound of the degrees of freedom of :class:`StudentTSequence`: the variance
#: :math:`\nu / (\nu - 2)` of the noise stays finite.
NU_MIN = 2.0
#: Initial degrees of freedom of :class:`StudentTSequence`: close to the standard normal.
NU_INIT = 30.0


class StandardNormalSequence(SequenceBase):
    r"""Standard normal density of the real frames of a sequence (padding never enters).

    .. math:: \log p(Z) = \sum_{n\,:\,m_n = 1} \log\mathcal N(z_n; 0, I_D).

    The context of a conditional flow is ignored.

    Args:
        features: Feature size ``D``.

    Example:
        >>> base = StandardNormalSequence(2)
        >>> mask = torch.tensor([[True, True, False]])
        >>> z = base.sample(mask, generator=torch.Generator().manual_seed(0))
        >>> z.shape, bool((z[0, 2] == 0).all()), base.log_prob(z, mask).shape
        (torch.Size([1, 3, 2]), True, torch.Size([1]))
    """

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)

    def log_prob(
        self, z: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """See :meth:`SequenceBase.log_prob`; ``context`` is ignored."""
        return self.frame_log_prob(z, mask).sum(-1)

    def frame_log_prob(
        self, z: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """See :meth:`SequenceBase.frame_log_prob`: the frames are independent."""
        per_frame = -0.5 * z.square().sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
        return _real_frames(per_frame, mask)

    def sample(
        self,
        mask: Tensor,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        *,
        context: Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        r"""Draw :math:`z_n \sim \mathcal N(0, T^2 I_D)` on the real frames, zeros at padding.

        Args:
            mask: Boolean padding mask ``(B, N)``; the noise is drawn on its device.
            generator: Optional ``torch.Generator`` (on the mask's device).
            temperature: Standard deviation :math:`T > 0`.
            context: Ignored.
            dtype: Floating dtype of the noise (default: torch's default dtype).

        Returns:
            Noise of shape ``(B, N, D)``.
        """
        generator, temperature = _check_draw(mask, generator, temperature)
        z = torch.randn(*mask.shape, self.features, generator=generator, device=mask.device,
                        dtype=dtype) * temperature
        return torch.where(mask.unsqueeze(-1), z, 0.0)

    def sample_given(
        self,
        z: Tensor,
        observed: Tensor,
        mask: Tensor,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        *,
        context: Tensor | None = None,
    ) -> Tensor:
        """See :meth:`SequenceBase.sample_given`: the frames are independent, so the new ones
        are standard normal whatever the observed ones."""
        return self.sample_new(z, observed, mask, generator, temperature, context=context)

    def given_scale(self, z: Tensor, observed: Tensor) -> Tensor:
        """See :meth:`SequenceBase.given_scale`: 1, the frames are independent."""
        return z.new_ones(z.shape[0])

    def extra_repr(self) -> str:
        return f"features={self.features}"


class StudentTSequence(SequenceBase):
    r"""Student-t density of the real frames, with learned degrees of freedom
    (docs/math.md#student-t-base).

    The coordinates of the real frames are cut into groups that share one chi-square scale:
    ``group="feature"``: every feature of every frame is an independent Student-t with unit
    scale and its own degrees of freedom :math:`\nu_d`; ``group="frame"``: every frame is a
    :math:`D`-variate t with identity scale and one :math:`\nu` (a frame far out in one feature
    tends to be far out in others); ``group="sequence"``: all real frames of a sequence form one
    :math:`nD`-variate t (:math:`n` real frames), one :math:`\nu` (a sequence is a Gaussian
    scaled by one random factor of its own, so a quiet and a loud recording are both likely).
    For a group of :math:`k` coordinates with squared norm :math:`q`,

    .. math::
        \log p = \log\Gamma\big(\tfrac{\nu + k}{2}\big) - \log\Gamma\big(\tfrac{\nu}{2}\big)
        - \tfrac{k}{2}\log(\pi\nu) - \tfrac{\nu + k}{2}\log\big(1 + \tfrac{q}{\nu}\big),

    summed over the groups. :math:`\nu = \nu_{\min} + e^{\eta}` with the parameter
    :attr:`log_excess` :math:`\eta` (an optimiser step changes :math:`\nu - 2` by a fraction of
    itself) and :data:`NU_MIN` :math:`= 2`, so the variance exists. The context of a conditional
    flow is ignored (its last layer shifts and scales the noise per context).

    Args:
        features: Feature size ``D``.
        group: ``"feature"``, ``"frame"`` or ``"sequence"`` (:data:`T_GROUPS`; the bases
            ``student-t``, ``multivariate-t`` and ``sequence-t`` of :data:`BASES`).
        nu_init: Initial degrees of freedom, ``> NU_MIN`` (default :data:`NU_INIT`, nearly
            Gaussian).

    Example:
        >>> base = StudentTSequence(2, nu_init=5.0)
        >>> mask = torch.tensor([[True, True, False]])
        >>> z = base.sample(mask, generator=torch.Generator().manual_seed(0))
        >>> z.shape, bool((z[0, 2] == 0).all()), base.log_prob(z, mask).shape
        (torch.Size([1, 3, 2]), True, torch.Size([1]))
        >>> base.nu.detach().tolist()
        [5.0, 5.0]
    """

    def __init__(
        self, features: int, *, group: str = "feature", nu_init: float = NU_INIT
    ) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        if group not in T_GROUPS:
            raise ValueError(f"group must be one of {', '.join(T_GROUPS)}, got {group!r}")
        self.group = group
        nu_init = check_float(nu_init, "nu_init", NU_MIN)
        #: :math:`\eta = \log(\nu - \nu_{\min})`, one per feature, or one ``(G,)``.
        self.log_excess = nn.Parameter(
            torch.full((self.features if group == "feature" else 1,),
                       math.log(nu_init - NU_MIN))
        )

    @property
    def nu(self) -> Tensor:
        """Degrees of freedom ``(G,)``: one per feature (``G = D``), or one."""
        return NU_MIN + self.log_excess.exp()

    def log_prob(
        self, z: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """See :meth:`SequenceBase.log_prob`; ``context`` is ignored."""
        nu = self.nu
        if self.group == "sequence":
            frames = z.shape[1] if mask is None else mask.sum(-1).to(z.dtype)
            square = _real_frames(z.square().sum(-1), mask).sum(-1)
            return _t_log_density(square, frames * self.features, nu)
        return self.frame_log_prob(z, mask).sum(-1)

    def frame_log_prob(
        self, z: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        r"""See :meth:`SequenceBase.frame_log_prob`. Groups ``"feature"`` and ``"frame"`` lie
        within a frame; for ``"sequence"`` frame :math:`t` gets
        :math:`\log t_{\nu, k_t}(q_t) - \log t_{\nu, k_{t-1}}(q_{t-1})`, with :math:`k_t` and
        :math:`q_t` the number and squared norm of the coordinates of the real frames up to
        :math:`t` (docs/forecasting.md#frame-scores)."""
        nu = self.nu
        if self.group == "sequence":
            real = torch.ones(z.shape[:2], dtype=torch.bool, device=z.device) if mask is None \
                else mask
            square = _real_frames(z.square().sum(-1), real).cumsum(-1)
            coordinates = real.cumsum(-1).to(z.dtype) * self.features
            cumulative = _t_log_density(square, coordinates, nu)
            previous = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))
            return _real_frames(cumulative - previous, real)
        if self.group == "frame":
            per_frame = _t_log_density(z.square().sum(-1), float(self.features), nu)
        else:
            per_frame = _t_log_density(z.square(), 1.0, nu).sum(-1)
        return _real_frames(per_frame, mask)

    def sample(
        self,
        mask: Tensor,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        *,
        context: Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        r"""Draw :math:`T\,t` on the real frames, zeros at padding.

        :math:`t = g \sqrt{\nu / w}` with :math:`g \sim \mathcal N(0, I)` and a chi-square
        :math:`w = 2\gamma \sim \chi^2_\nu`, :math:`\gamma \sim \mathrm{Gamma}(\nu/2, 1)` per
        group (feature, frame or sequence; :func:`~iresflow.models.gamma.sample_gamma`), all
        drawn from the generator; the draw is not differentiable in :math:`\nu`.

        Args:
            mask: Boolean padding mask ``(B, N)``; the noise is drawn on its device.
            generator: Optional ``torch.Generator`` (on the mask's device).
            temperature: Scale :math:`T > 0` of the draw.
            context: Ignored.
            dtype: Floating dtype of the noise (default: torch's default dtype).

        Returns:
            Noise of shape ``(B, N, D)``.
        """
        generator, temperature = _check_draw(mask, generator, temperature)
        g = torch.randn(*mask.shape, self.features, generator=generator, device=mask.device,
                        dtype=dtype)
        nu = self.nu.detach().to(device=mask.device, dtype=g.dtype)
        groups = {"feature": (*mask.shape, self.features), "frame": (*mask.shape, 1),
                  "sequence": (mask.shape[0], 1, 1)}[self.group]
        chi_square = 2 * sample_gamma((nu / 2).expand(groups), generator)
        z = g * torch.sqrt(nu / chi_square) * temperature
        return torch.where(mask.unsqueeze(-1), z, 0.0)

    def sample_given(
        self,
        z: Tensor,
        observed: Tensor,
        mask: Tensor,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        *,
        context: Tensor | None = None,
    ) -> Tensor:
        r"""See :meth:`SequenceBase.sample_given` (docs/forecasting.md#conditional-noise).

        Groups ``"feature"`` and ``"frame"`` lie within a frame, so new frames are a fresh
        draw. For ``"sequence"``, given :math:`k_o` observed coordinates with squared norm
        :math:`q_o`, the new ones are a t with :math:`\nu + k_o` degrees of freedom and scale
        :math:`\sqrt{(\nu + q_o) / (\nu + k_o)}`: :math:`T\, g \sqrt{(\nu + q_o) / w}` with
        :math:`w \sim \chi^2_{\nu + k_o}`, one per sequence.
        """
        if self.group != "sequence":
            return self.sample_new(z, observed, mask, generator, temperature, context=context)
        generator, temperature = _check_draw(mask, generator, temperature)
        nu, known, square = self._observed(z, observed)
        g = torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
        chi_square = 2 * sample_gamma((nu + known) / 2, generator)
        new = g * (torch.sqrt((nu + square) / chi_square) * temperature)[:, None, None]
        return torch.where(observed.unsqueeze(-1), z,
                           torch.where((mask & ~observed).unsqueeze(-1), new, 0.0))

    def given_scale(self, z: Tensor, observed: Tensor) -> Tensor:
        r"""See :meth:`SequenceBase.given_scale`: 1 for the groups within a frame; for
        ``"sequence"``, the scale :math:`\sqrt{(\nu + q_o) / (\nu + k_o)}` of the t of the new
        coordinates (:meth:`sample_given`).

        Example:
            >>> base = StudentTSequence(1, group="sequence", nu_init=4.0)
            >>> z = torch.tensor([[[1.0], [1.0], [0.0]], [[10.0], [10.0], [0.0]]])
            >>> observed = torch.tensor([[True, True, False], [True, True, False]])
            >>> base.given_scale(z, observed)
            tensor([1.0000, 5.8310])
        """
        if self.group != "sequence":
            return z.new_ones(z.shape[0])
        nu, known, square = self._observed(z, observed)
        return torch.sqrt((nu + square) / (nu + known))

    def _observed(self, z: Tensor, observed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(nu, k_o, q_o)``: the degrees of freedom, and the number of observed coordinates
        and their squared norm per sequence ``(B,)``."""
        nu = self.nu.detach().to(device=z.device, dtype=z.dtype)
        known = observed.sum(-1).to(z.dtype) * self.features
        square = _real_frames(z.square().sum(-1), observed).sum(-1)
        return nu, known, square

    def extra_repr(self) -> str:
        return f"features={self.features}, group={self.group}"

def _t_log_density(square: Tensor, k: Tensor | float, nu: Tensor) -> Tensor:
    """Log-density of a ``k``-variate t with identity scale at squared norm ``square``."""
    return (torch.lgamma((nu + k) / 2) - torch.lgamma(nu / 2) - 0.5 * k * torch.log(math.pi * nu)
            - 0.5 * (nu + k) * torch.log1p(square / nu))


def _real_frames(per_frame: Tensor, mask: Tensor | None) -> Tensor:
    """A per-frame quantity ``(B, N)`` at the real frames of ``mask`` ``(B, N)``, 0 at padding."""
    return per_frame if mask is None else torch.where(mask, per_frame, 0.0)


def _check_draw(
    mask: Tensor, generator: torch.Generator | None, temperature: float
) -> tuple[torch.Generator | None, float]:
    """The checked ``generator`` and ``temperature`` of :meth:`SequenceBase.sample`, after
    checking that ``mask`` is a boolean ``(B, N)`` tensor."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError("mask must be a boolean torch.Tensor of shape (B, N)")
    return check_generator(generator), check_float(temperature, "temperature", 0.0)


@dataclass(frozen=True)
class BaseKind:
    """A base density of the model setting ``base``: how to build it, and what it is.

    Attributes:
        build: ``build(features) -> SequenceBase``, the density for feature size ``D``.
        help: One line saying what the density is.
    """

    build: Callable[[int], SequenceBase]
    help: str


#: The base densities of the model setting ``base``, by name (:func:`register_base`).
BASES: Registry[BaseKind] = Registry("base")


def register_base(name: str, build: Callable[[int], SequenceBase], help: str) -> None:
    """Register a base density, usable in the model setting ``base``.

    Args:
        name: Its name: lower-case letters, digits, ``-`` and ``_``, starting with a letter,
            not yet a base.
        build: ``build(features) -> SequenceBase`` for feature size ``D``.
        help: One line saying what the density is.

    Raises:
        TypeError: ``name`` or ``help`` is not a string, or ``build`` is not callable.
        ValueError: ``name`` is malformed or already a base, or ``help`` is empty.

    Example:
        >>> register_base("t-per-frame", partial(StudentTSequence, group="frame"), "a t per frame")
        >>> make_base("t-per-frame", 3).group
        'frame'
        >>> BASES.unregister("t-per-frame")
    """
    if not callable(build):
        raise TypeError(f"build must be callable, got {type(build).__name__}")
    if not isinstance(help, str):
        raise TypeError(f"help must be a str, got {type(help).__name__}")
    if not help.strip():
        raise ValueError("help must say what the density is, got an empty string")
    BASES.register(name, BaseKind(build, help))


def make_base(kind: str, features: int) -> SequenceBase:
    """Build the base density of a flow by the name of the model setting ``base``.

    Args:
        kind: A name of :data:`BASES`: built in, ``"normal"`` (:class:`StandardNormalSequence`),
            ``"student-t"`` (independent Student-t features), ``"multivariate-t"`` (one
            multivariate t per frame) or ``"sequence-t"`` (one multivariate t over the real
            frames of a sequence).
        features: Feature size ``D``.

    Returns:
        The base, with :data:`NU_INIT` degrees of freedom for a built-in t.

    Raises:
        ValueError: an unknown ``kind``.

    Example:
        >>> make_base("multivariate-t", 3).nu.shape
        torch.Size([1])
    """
    if kind not in BASES:
        raise ValueError(f"base must be one of {', '.join(BASES)}, got {kind!r}")
    return BASES[kind].build(features)


register_base("normal", StandardNormalSequence, "the standard normal")
register_base("student-t", partial(StudentTSequence, group="feature"),
              "a Student-t per feature, with learned degrees of freedom")
register_base("multivariate-t", partial(StudentTSequence, group="frame"),
              "one multivariate t per frame")
register_base("sequence-t", partial(StudentTSequence, group="sequence"),
              "one multivariate t over the real frames of a sequence")
