r"""Synthetic long-range sequence families with an exact log-density (the NLL floor).

Two generators whose sequences depend on frames far back in time, each with its log-density in
closed form, so that a model's NLL can be read against the best achievable value:

* :class:`RepeatedMotif`: every sequence repeats its own random motif at its own random period
  :math:`P`; the dependence is long-range and found by content, not by a fixed lag. Its density
  is a uniform mixture over :math:`P` of Gaussians, evaluated exactly with Sherman–Morrison.
* :class:`NonlinearSeasonal`: a nonlinear autoregression on the frame one period back
  (:math:`P = 24`, beyond the receptive field of local layers) and the previous frame; its
  density is the chain rule of Gaussian conditionals.

:func:`load_synthetic` turns a family into a :class:`~iresflow.data.splits.SequenceDataset` with
fixed split sizes (``load_dataset("repeated_motif")``), and :func:`synthetic_family` returns the
family of a dataset name, whose ``log_prob`` gives the floor:
``ds.nll(synthetic_family(ds.name).log_prob(ds.test.x, ds.test.mask), ds.test)``.
The formulas are derived in ``docs/datasets.md#synthetic-long-range-families``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from iresflow._validation import check_mask, check_sequence
from iresflow.data.splits import SequenceDataset, SequenceSplit

__all__ = ["SPLIT_SIZES", "NonlinearSeasonal", "RepeatedMotif", "load_synthetic",
           "synthetic_family", "synthetic_names"]

#: Sequences in the train, validation and test splits of every synthetic dataset.
SPLIT_SIZES = (1000, 200, 500)
#: Seed of the generator of the test split: the same test sequences for every ``seed``.
TEST_SEED = 0
#: The only ``val_fraction`` a synthetic dataset accepts besides ``None`` (its split sizes are
#: fixed), and the one its datasets record.
DEFAULT_VAL_FRACTION = 0.1

_LOG_2PI = math.log(2.0 * math.pi)


def _float64_inputs(x: Tensor, mask: Tensor | None, features: int, length: int) -> tuple[
        Tensor, Tensor]:
    """Checked ``x`` as float64 zero at padding ``(B, N, D)`` and a full mask ``(B, N)``."""
    check_sequence(x, "x", features=features, allow_2d=False)
    if x.shape[1] > length:
        raise ValueError(f"x must have at most {length} frames, got {x.shape[1]}")
    checked = check_mask(mask, x)
    full = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if checked is None \
        else checked
    return torch.where(full.unsqueeze(-1), x.to(torch.float64), 0.0), full


@dataclass(frozen=True)
class RepeatedMotif:
    r"""Sequences that repeat a random motif at a random period.

    A sequence draws a period :math:`P` uniformly from ``min_period..max_period`` and a motif
    :math:`m \in \mathbb R^{P\times D}` with i.i.d. :math:`\mathcal N(0, s_m^2)` entries; frame
    :math:`t = 0..N-1` is :math:`x_t = m_{t \bmod P} + \varepsilon_t`,
    :math:`\varepsilon_t \sim \mathcal N(0, s^2 I)`. Given :math:`P`, the frames of one feature
    whose times are congruent modulo :math:`P` form a Gaussian vector with covariance
    :math:`s_m^2 \mathbf 1\mathbf 1^\top + s^2 I`, independent of the other classes and
    features, so

    .. math::

        p(x) = \frac1K\sum_{P} \prod_{d}\prod_{r=0}^{P-1}
        \mathcal N\big(x_{C_r, d};\, 0,\, s_m^2 \mathbf 1\mathbf 1^\top + s^2 I\big),

    with :math:`K` periods and :math:`C_r = \{t : t \equiv r \ (\mathrm{mod}\ P)\}` (the
    observed ones: a mask with gaps marginalises the missing frames out exactly).

    Attributes:
        length: Frames per sequence :math:`N`.
        features: Features per frame :math:`D`.
        min_period: Smallest period.
        max_period: Largest period (inclusive).
        motif_scale: :math:`s_m`.
        noise_scale: :math:`s`.

    Example:
        >>> family = RepeatedMotif()
        >>> x, periods = family.sample(3, torch.Generator().manual_seed(0))
        >>> x.shape, family.log_prob(x).shape, bool((periods >= 8).all())
        (torch.Size([3, 64, 2]), torch.Size([3]), True)
    """

    length: int = 64
    features: int = 2
    min_period: int = 8
    max_period: int = 24
    motif_scale: float = 1.0
    noise_scale: float = 0.1

    @property
    def periods(self) -> range:
        """The periods :math:`P` of the mixture, ``min_period..max_period``."""
        return range(self.min_period, self.max_period + 1)

    def sample(self, num: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draw sequences and their periods.

        Args:
            num: Number of sequences.
            generator: Optional CPU ``torch.Generator``.

        Returns:
            ``(x, periods)``: float64 ``(num, N, D)`` and int64 ``(num,)``.
        """
        n, d = self.length, self.features
        periods = torch.randint(self.min_period, self.max_period + 1, (num,), generator=generator)
        motifs = self.motif_scale * torch.randn(num, self.max_period, d, generator=generator,
                                                dtype=torch.float64)
        phase = torch.arange(n) % periods.unsqueeze(1)  # (num, N)
        x = torch.gather(motifs, 1, phase.unsqueeze(-1).expand(num, n, d))
        noise = torch.randn(num, n, d, generator=generator, dtype=torch.float64)
        return x + self.noise_scale * noise, periods

    def period_log_likelihoods(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        r"""Log-density of the observed frames given each period, :math:`\log p(x \mid P)`.

        Per class of :math:`n` observed frames with values :math:`v`: log-determinant
        :math:`n\log s^2 + \log(1 + n s_m^2/s^2)` and quadratic form
        :math:`(\lVert v\rVert^2 - s_m^2 (\mathbf 1^\top v)^2/(s^2 + n s_m^2))/s^2`
        (Sherman–Morrison).

        Args:
            x: Sequences ``(B, N', D)`` with ``N' <= length``.
            mask: Boolean ``(B, N')``, ``True`` for observed frames (any pattern), or ``None``.

        Returns:
            float64 ``(B, K)``, column ``k`` for period ``min_period + k``.
        """
        x, mask = _float64_inputs(x, mask, self.features, self.length)
        var_m, var_e = self.motif_scale**2, self.noise_scale**2
        observed = mask.to(torch.float64)
        frames = observed.sum(1)  # (B,)
        squares = x.square().sum((1, 2))  # zero at padding
        time = torch.arange(x.shape[1], device=x.device)
        columns = []
        for period in self.periods:
            classes = torch.nn.functional.one_hot(time % period, period).to(torch.float64)
            counts = observed @ classes  # (B, P)
            sums = torch.einsum("bnd,nk->bkd", x, classes)  # (B, P, D)
            shrink = var_m / (var_e + counts * var_m)  # (B, P)
            quadratic = (squares - (shrink.unsqueeze(-1) * sums.square()).sum((1, 2))) / var_e
            log_det = frames * math.log(var_e) + torch.log1p(counts * var_m / var_e).sum(1)
            columns.append(-0.5 * (self.features * (frames * _LOG_2PI + log_det) + quadratic))
        return torch.stack(columns, 1)

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Exact log-density of the observed frames: log-sum-exp over the periods.

        Args:
            x: Sequences ``(B, N', D)`` with ``N' <= length``.
            mask: Boolean ``(B, N')``, ``True`` for observed frames (any pattern), or ``None``.

        Returns:
            float64 ``(B,)``.
        """
        table = self.period_log_likelihoods(x, mask)
        return torch.logsumexp(table, 1) - math.log(table.shape[1])


@dataclass(frozen=True)
class NonlinearSeasonal:
    r"""A nonlinear seasonal autoregression: each frame depends on the frame one period back.

    The first :math:`P` frames are i.i.d. :math:`\mathcal N(0, s_0^2 I)`; for :math:`t \ge P`

    .. math::

        x_t = a \tanh\!\big(b\, W x_{t-P}\big) + c\, x_{t-1} + \sigma\,\varepsilon_t,
        \qquad \varepsilon_t \sim \mathcal N(0, I),

    with :math:`W` the signed cyclic shift of the features
    (:math:`(Wx)_0 = -x_{D-1}`, :math:`(Wx)_d = x_{d-1}`; a rotation by 90 degrees for
    :math:`D = 2`). The log-density of a sequence (or of a prefix of it) is the sum of the
    Gaussian conditionals.

    Attributes:
        length: Frames per sequence :math:`N`.
        features: Features per frame :math:`D`.
        period: :math:`P`.
        amplitude: :math:`a`.
        gain: :math:`b`.
        carry: :math:`c`.
        noise_scale: :math:`\sigma`.
        initial_scale: :math:`s_0`.

    Example:
        >>> family = NonlinearSeasonal()
        >>> x = family.sample(3, torch.Generator().manual_seed(0))
        >>> x.shape, family.log_prob(x).shape
        (torch.Size([3, 96, 2]), torch.Size([3]))
    """

    length: int = 96
    features: int = 2
    period: int = 24
    amplitude: float = 1.5
    gain: float = 2.0
    carry: float = 0.3
    noise_scale: float = 0.2
    initial_scale: float = 1.0

    def conditional_mean(self, back: Tensor, previous: Tensor) -> Tensor:
        """Mean of :math:`x_t` given :math:`x_{t-P}` and :math:`x_{t-1}`, ``(..., D)`` each."""
        shifted = torch.cat([-back[..., -1:], back[..., :-1]], -1)
        return self.amplitude * torch.tanh(self.gain * shifted) + self.carry * previous

    def sample(self, num: int, generator: torch.Generator | None = None) -> Tensor:
        """Draw sequences by ancestral sampling.

        Args:
            num: Number of sequences.
            generator: Optional CPU ``torch.Generator``.

        Returns:
            float64 ``(num, N, D)``.
        """
        p = self.period
        noise = torch.randn(num, self.length, self.features, generator=generator,
                            dtype=torch.float64)
        frames = list((self.initial_scale * noise[:, :p]).unbind(1))
        for t in range(p, self.length):
            mean = self.conditional_mean(frames[t - p], frames[t - 1])
            frames.append(mean + self.noise_scale * noise[:, t])
        return torch.stack(frames, 1)

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Exact log-density of the real frames, a prefix of every sequence.

        Args:
            x: Sequences ``(B, N', D)`` with ``N' <= length``.
            mask: Boolean ``(B, N')``, ``True`` for the real frames, each row a prefix (the
                density of a sequence with gaps has no closed form here), or ``None``.

        Returns:
            float64 ``(B,)``.

        Raises:
            ValueError: a mask row that is not a prefix.
        """
        x, mask = _float64_inputs(x, mask, self.features, self.length)
        time = torch.arange(x.shape[1], device=x.device)
        if bool((mask != (time < mask.sum(1, keepdim=True))).any()):
            raise ValueError("mask must mark a prefix of every sequence (True, then False)")
        p = self.period
        mean = torch.zeros_like(x)
        mean[:, p:] = self.conditional_mean(x[:, :-p], x[:, p - 1 : -1])
        scale = torch.where(time < p, self.initial_scale, self.noise_scale)  # (N',)
        z = (x - mean) / scale.unsqueeze(-1)
        per_frame = -0.5 * z.square().sum(-1) - self.features * (scale.log() + 0.5 * _LOG_2PI)
        return torch.where(mask, per_frame, 0.0).sum(1)


_FAMILIES: dict[str, RepeatedMotif | NonlinearSeasonal] = {
    "repeated_motif": RepeatedMotif(),
    "nonlinear_seasonal": NonlinearSeasonal(),
}


def synthetic_names() -> list[str]:
    """Names of the synthetic datasets.

    Returns:
        ``["repeated_motif", "nonlinear_seasonal"]``.
    """
    return list(_FAMILIES)


def synthetic_family(name: str) -> RepeatedMotif | NonlinearSeasonal:
    """The generator and exact density of a synthetic dataset.

    Args:
        name: One of :func:`synthetic_names`.

    Returns:
        The family: ``sample`` draws sequences, ``log_prob(x, mask)`` ``(B,)`` is their exact
        log-density in the dataset's model space (which is its raw space).

    Raises:
        ValueError: an unknown name.

    Example:
        >>> synthetic_family("nonlinear_seasonal").period
        24
    """
    if name not in _FAMILIES:
        raise ValueError(f"unknown synthetic dataset {name!r}; available: {synthetic_names()}")
    return _FAMILIES[name]


def _split(x: Tensor) -> SequenceSplit:
    mask = torch.ones(x.shape[:2], dtype=torch.bool)
    return SequenceSplit(x.to(torch.float32), mask, torch.zeros(x.shape[0], dtype=torch.float64))


def load_synthetic(name: str, seed: int = 0,
                   val_fraction: float | None = DEFAULT_VAL_FRACTION) -> SequenceDataset:
    """A synthetic dataset: fixed-size splits drawn from the family's generator.

    The test split (:data:`SPLIT_SIZES`) is drawn from a generator seeded with
    :data:`TEST_SEED`, the same for every ``seed``; the training and validation splits from a
    generator seeded with ``2 * seed + 1``, so they never repeat the test sequences. The data are
    not preprocessed: model space is raw space, ``log_jacobian`` is zero, the unit nats/frame.

    Args:
        name: One of :func:`synthetic_names`.
        seed: Seed ``>= 0`` of the training and validation sequences.
        val_fraction: :data:`DEFAULT_VAL_FRACTION` or ``None`` (the split sizes are fixed).

    Returns:
        The dataset.

    Raises:
        ValueError: an unknown name, a negative seed or another ``val_fraction``.

    Example:
        >>> ds = load_synthetic("repeated_motif")
        >>> len(ds.train), len(ds.val), len(ds.test), ds.test.x.shape
        (1000, 200, 500, torch.Size([500, 64, 2]))
    """
    family = synthetic_family(name)
    if val_fraction not in (None, DEFAULT_VAL_FRACTION):
        raise ValueError(f"{name} has fixed split sizes {SPLIT_SIZES} (train, val, test); "
                         f"val_fraction must be {DEFAULT_VAL_FRACTION}, got {val_fraction}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0 for {name}, got {seed}")
    n_train, n_val, n_test = SPLIT_SIZES
    train_val = family.sample(n_train + n_val, torch.Generator().manual_seed(2 * seed + 1))
    test = family.sample(n_test, torch.Generator().manual_seed(TEST_SEED))
    if isinstance(family, RepeatedMotif):
        train_val, test = train_val[0], test[0]  # drop the periods
    return SequenceDataset(name=name, features=family.features, max_len=family.length,
                           unit="nats/frame", train=_split(train_val[:n_train]),
                           val=_split(train_val[n_train:]), test=_split(test),
                           val_fraction=DEFAULT_VAL_FRACTION)
