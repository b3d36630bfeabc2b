r"""The closed-form reference density: a linear-Gaussian AR(p) model over frames.

The model every sequence-density result should be compared with (docs/small_data.md). For a
real frame :math:`t` let :math:`h(t)\in\{0,\dots,p\}` be the number of consecutive real frames
immediately before it, capped at :math:`p` (the history of the flow's
:class:`~iresflow.transforms.temporal.AutoregressiveLinear` layer: it stops at the start of the
sequence and at a padded or missing frame). Then

.. math::

    x_t \mid x_{t-1},\dots,x_{t-h} \sim \mathcal N\!\big(b_h + \textstyle\sum_{k=1}^{h}
    A_{h,k}\,x_{t-k},\; S_h\big),\qquad h = h(t),

so the first frame of a sequence, or of a run after a gap, has a full-covariance Gaussian
(:math:`h=0`), and a frame with :math:`p` real predecessors the :math:`\mathrm{AR}(p)`
conditional. Sub-model :math:`h<p` is fitted on the real frames with exactly :math:`h` real
predecessors, sub-model :math:`p` on every real frame with at least :math:`p`. Each fit is the
Gaussian maximum-likelihood estimate: least squares for :math:`(A_h, b_h)` (minimum-norm if the
regressors are collinear) and the (``1/M``) residual covariance plus a ridge :math:`\lambda I`
for :math:`S_h`. With :math:`p=0` the model is the full-covariance Gaussian over i.i.d. frames.
The log-density of a sequence is the sum of its conditionals over its real frames
(docs/math.md#change-of-variables, docs/math.md#masks); padded and missing frames never enter.

:meth:`AutoregressiveGaussian.fit_selected_order` chooses :math:`p\in\{0,\dots,P\}` by the
validation likelihood of fits on the training split, then refits the chosen order on the
training and validation sequences together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from scipy import stats
from torch import Tensor, nn

from iresflow._validation import check_int, check_mask, check_sequence
from iresflow.models.distributions import sample_mask
from iresflow.transforms.positionwise import positionwise_moments

__all__ = [
    "AutoregressiveGaussian",
    "MaskedSequences",
    "PositionwiseEvidence",
    "history_lags",
    "positionwise_evidence",
]

#: Level of the one-sided signed-rank test of :attr:`PositionwiseEvidence.favours`
#: (docs/math.md#positionwise-affine).
EVIDENCE_LEVEL = 0.05


class MaskedSequences(Protocol):
    """What :meth:`AutoregressiveGaussian.fit_selected_order` reads from a split.

    A :class:`~iresflow.data.datasets.SequenceSplit` is one: ``x`` ``(B, N, D)`` and ``mask``
    ``(B, N)`` (``True`` for real frames).
    """

    x: Tensor
    mask: Tensor


def history_lags(x: Tensor, mask: Tensor | None, order: int) -> tuple[Tensor, Tensor]:
    r"""The real history of every frame: its lags and its capped history length :math:`h(t)`.

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Padding mask ``(B, N)`` (``True`` = real) or ``None`` (all real).
        order: Number of lags :math:`p \ge 0`.

    Returns:
        ``(lags, h)``: ``lags`` ``(B, N, p D)`` whose block :math:`k` (``[..., (k-1) D : k D]``)
        at position :math:`t` is :math:`x_{t-k}` if :math:`k \le h(t)` and zero otherwise;
        ``h`` ``(B, N)`` int64, the number of consecutive real frames right before :math:`t`
        (stopping at the start or at a padded frame), at most ``order``.

    Example:
        >>> x = torch.arange(1.0, 6.0).reshape(1, 5, 1)
        >>> lags, h = history_lags(x, torch.tensor([[True, True, False, True, True]]), 2)
        >>> lags[0].tolist(), h[0].tolist()
        ([[0.0, 0.0], [1.0, 0.0], [2.0, 1.0], [0.0, 0.0], [4.0, 0.0]], [0, 1, 2, 0, 1])
    """
    b, n, d = x.shape
    real = torch.ones(b, n, dtype=torch.bool, device=x.device) if mask is None else mask
    in_run = torch.ones_like(real)
    h = torch.zeros(b, n, dtype=torch.long, device=x.device)
    lags = []
    for k in range(1, order + 1):
        shift = min(k, n)
        earlier = torch.cat([x.new_zeros(b, shift, d), x[:, : n - shift]], 1)
        earlier_real = torch.cat([real.new_zeros(b, shift), real[:, : n - shift]], 1)
        in_run = in_run & earlier_real  # frames t-1, ..., t-k are all real
        h = h + in_run.long()
        lags.append(torch.where(in_run.unsqueeze(-1), earlier, 0.0))
    return (torch.cat(lags, -1) if lags else x.new_zeros(b, n, 0)), h


def _gaussian_fit(residuals: Tensor, ridge: float) -> tuple[Tensor, Tensor]:
    """Mean ``(D,)`` and Cholesky factor ``(D, D)`` of ``residuals`` ``(M, D)`` plus a ridge."""
    mean = residuals.mean(0)
    centred = residuals - mean
    eye = torch.eye(residuals.shape[1], dtype=residuals.dtype, device=residuals.device)
    return mean, torch.linalg.cholesky(centred.T @ centred / residuals.shape[0] + ridge * eye)


class AutoregressiveGaussian(nn.Module):
    r"""Linear-Gaussian :math:`\mathrm{AR}(p)` model over the real frames of sequences.

    The fitted conditionals are float64 buffers, zero-padded to ``p`` lags: ``weight``
    ``(p+1, pD, D)`` (sub-model :math:`h` uses its first :math:`hD` rows; rows
    :math:`(k-1)D..kD` hold :math:`A_{h,k}^\top`), ``bias`` ``(p+1, D)`` and ``scale_tril``
    ``(p+1, D, D)`` (Cholesky factors of :math:`S_h`). Before a fit the model is the standard
    normal over frames (:math:`p = 0`).

    Args:
        features: Frame size :math:`D`.
        max_len: Longest sequence :meth:`sample` may produce.
        ridge: Ridge :math:`\lambda\ge 0` added to every residual covariance.

    Example:
        >>> x = torch.randn(64, 6, 2, dtype=torch.float64).cumsum(1)
        >>> model = AutoregressiveGaussian(2, max_len=6).fit(x, order=1)
        >>> samples, mask = model.sample(3, lengths=torch.tensor([6, 2, 4]))
        >>> model.log_prob(x).shape, samples.shape, samples[1, 2:].abs().sum().item()
        (torch.Size([64]), torch.Size([3, 6, 2]), 0.0)
    """

    weight: Tensor
    bias: Tensor
    scale_tril: Tensor

    def __init__(self, features: int, max_len: int, ridge: float = 1e-4) -> None:
        super().__init__()
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not (
                math.isfinite(ridge) and ridge >= 0):
            raise ValueError(f"ridge must be a finite float >= 0, got {ridge!r}")
        self.features = check_int(features, "features", 1)
        self.max_len = check_int(max_len, "max_len", 1)
        self.ridge = float(ridge)
        self.register_buffer("weight", torch.zeros(1, 0, features, dtype=torch.float64))
        self.register_buffer("bias", torch.zeros(1, features, dtype=torch.float64))
        self.register_buffer("scale_tril", torch.eye(features, dtype=torch.float64)[None])

    @property
    def order(self) -> int:
        """The order :math:`p` of the fit."""
        return self.weight.shape[0] - 1

    @property
    def num_parameters(self) -> int:
        r"""Free parameters: :math:`\sum_{h=0}^{p} (h D^2 + D + D(D+1)/2)`."""
        d = self.features
        return sum(h * d * d + d + d * (d + 1) // 2 for h in range(self.order + 1))

    def _prepare(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Checked float64 ``x`` with zeros at padding, and a full ``(B, N)`` mask."""
        check_sequence(x, "x", features=self.features, allow_2d=False)
        mask = check_mask(mask, x)
        if mask is None:
            mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        return torch.where(mask.unsqueeze(-1), x.to(torch.float64), 0.0), mask

    def fit(self, x: Tensor, mask: Tensor | None = None, order: int = 1) -> AutoregressiveGaussian:
        r"""Fit the sub-models :math:`h = 0..p` on the real frames of ``x`` in closed form.

        Args:
            x: Sequences ``(B, N, D)``; values at padded frames are ignored.
            mask: Padding mask ``(B, N)`` or ``None``.
            order: :math:`p \ge 0`; some run of consecutive real frames needs more than
                :math:`p` frames.

        Returns:
            ``self``, with float64 buffers on ``x``'s device.

        Raises:
            TypeError: ``order`` is not an int.
            ValueError: ``order < 0``, or no run of real frames longer than ``order``.
        """
        check_int(order, "order", 0)
        x, mask = self._prepare(x, mask)
        lags, h = history_lags(x, mask, order)
        d = self.features
        counts = [int(c) for c in torch.bincount(h[mask], minlength=order + 1)]
        if counts[order] == 0:
            raise ValueError(
                f"an order-{order} model needs a sequence with at least {order + 1} real frames "
                f"in a row (no gap) to fit its AR({order}) conditional; the data have none")
        weight = x.new_zeros(order + 1, order * d, d)
        bias = x.new_zeros(order + 1, d)
        tril = x.new_zeros(order + 1, d, d)
        for k in range(order + 1):
            rows = mask & (h == k)
            target = x[rows]
            design = torch.cat([lags[rows][:, : k * d], target.new_ones(counts[k], 1)], 1)
            solution = torch.linalg.pinv(design) @ target
            mean, tril[k] = _gaussian_fit(target - design @ solution, self.ridge)
            weight[k, : k * d] = solution[: k * d]
            bias[k] = solution[k * d] + mean  # the residual mean is 0 up to rounding
        self.weight, self.bias, self.scale_tril = weight, bias, tril
        return self

    def fit_selected_order(
        self, train: MaskedSequences, val: MaskedSequences, max_order: int = 3,
        *, refit: bool = True,
    ) -> list[float]:
        r"""Choose the order on the validation split, then refit it on train and validation.

        Every order :math:`p = 0..P'` is fitted on ``train`` and scored by its validation
        log-likelihood, :math:`P'` being ``max_order`` or less when the training split has no
        run of real frames longer than it; the best order is refitted on the sequences of both
        splits (``refit=True``) or kept as fitted on ``train``.

        Args:
            train: Training split (``x`` ``(B, N, D)``, ``mask`` ``(B, N)``).
            val: Validation split (same ``N`` and ``D``) with at least one real frame.
            max_order: :math:`P \ge 0`.
            refit: Refit the chosen order on ``train`` and ``val`` together.

        Returns:
            The validation NLL (nats per real frame, model space) of every order ``0..P'``.

        Raises:
            TypeError: ``max_order`` is not an int.
            ValueError: ``max_order < 0``, splits of other shapes, or an empty ``val``.

        Example:
            >>> from iresflow.data.datasets import SequenceSplit
            >>> x = torch.randn(40, 8, 1, dtype=torch.float64).cumsum(1)  # a random walk: AR(1)
            >>> full = torch.ones(20, 8, dtype=torch.bool)
            >>> jac = torch.zeros(20, dtype=torch.float64)
            >>> model = AutoregressiveGaussian(1, max_len=8)
            >>> val_nll = model.fit_selected_order(SequenceSplit(x[:20], full, jac),
            ...                                    SequenceSplit(x[20:], full, jac))
            >>> model.order >= 1, val_nll[1] < val_nll[0], len(val_nll)
            (True, True, 4)
        """
        check_int(max_order, "max_order", 0)
        if train.x.shape[1:] != val.x.shape[1:]:
            raise ValueError(f"train and val must share (N, D), got {tuple(train.x.shape[1:])} "
                             f"and {tuple(val.x.shape[1:])}")
        frames = float(val.mask.sum())
        if frames == 0:
            raise ValueError("val must hold at least one real frame to choose the order")
        # the highest order some run of real training frames can fit (h is capped at max_order)
        highest = int(history_lags(train.x, train.mask, max_order)[1][train.mask].max())
        val_nll = []
        for order in range(highest + 1):
            self.fit(train.x, train.mask, order)
            val_nll.append(-float(self.log_prob(val.x, val.mask).sum()) / frames)
        best = min(range(len(val_nll)), key=val_nll.__getitem__)
        if refit:
            self.fit(torch.cat([train.x, val.x]), torch.cat([train.mask, val.mask]), best)
        else:
            self.fit(train.x, train.mask, best)
        return val_nll

    def _innovations(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Standardised innovations ``(B, N, D)`` and ``log|det L_h(t)|`` ``(B, N)``."""
        lags, h = history_lags(x, mask, self.order)
        mean = torch.einsum("bnl,bnld->bnd", lags, self.weight[h]) + self.bias[h]
        tril = self.scale_tril[h]
        z = torch.linalg.solve_triangular(tril, (x - mean).unsqueeze(-1), upper=False)
        return z.squeeze(-1), tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-density of sequences, summed over their real frames, in float64.

        Args:
            x: Sequences ``(B, N, D)``; values at padded frames are ignored.
            mask: Padding mask ``(B, N)`` or ``None``.

        Returns:
            ``(B,)`` float64 (nats, model space).
        """
        x, mask = self._prepare(x, mask)
        z, log_det = self._innovations(x, mask)
        per_frame = (-0.5 * z.square().sum(-1) - log_det
                     - 0.5 * self.features * math.log(2 * math.pi))
        return torch.where(mask, per_frame, 0.0).sum(-1)

    def transform_to_noise(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        r"""Standardised innovations :math:`z_t = L_h^{-1}(x_t - b_h - \sum_k A_{h,k}x_{t-k})`.

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Padding mask ``(B, N)`` or ``None``.

        Returns:
            ``z`` ``(B, N, D)`` float64 at the real frames, ``x`` at padding.
        """
        prepared, full_mask = self._prepare(x, mask)
        z = self._innovations(prepared, full_mask)[0]
        return torch.where(full_mask.unsqueeze(-1), z, x.to(z.dtype))

    @torch.no_grad()
    def sample(
        self,
        num: int,
        seq_len: int | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Ancestral sampling of sequences whose frames are real up to their length.

        Args:
            num: Number of sequences.
            seq_len: Common length (exactly one of ``seq_len`` and ``lengths``).
            lengths: ``(num,)`` integer lengths in ``1..max_len``.
            generator: Optional ``torch.Generator`` (on the buffers' device).

        Returns:
            ``(x (num, N, D) float64, mask (num, N))``, ``x`` zero at padding.
        """
        mask = sample_mask(num, seq_len, lengths, self.max_len, self.bias.device)
        p, d = self.order, self.features
        eps = torch.randn(*mask.shape, d, generator=generator, device=self.bias.device,
                          dtype=self.bias.dtype)
        x = eps.new_zeros(eps.shape)
        for t in range(mask.shape[1]):
            k = min(t, p)
            past = x[:, t - k : t].flip(1).reshape(num, k * d)
            mean = past @ self.weight[k, : k * d] + self.bias[k]
            x[:, t] = mean + eps[:, t] @ self.scale_tril[k].T
        return torch.where(mask.unsqueeze(-1), x, 0.0), mask


class _Sequences(NamedTuple):
    x: Tensor
    mask: Tensor


@dataclass(frozen=True)
class PositionwiseEvidence:
    """Validation evidence for standardising every position separately.

    Attributes:
        gain: Mean over validation sequences of the log-likelihood gain (nats per sequence,
            model space) of the AR(p) Gaussian on per-position standardised frames over the
            AR(p) Gaussian on the frames themselves.
        pvalue: One-sided p-value of the Wilcoxon signed-rank test of the per-sequence gains
            against a distribution symmetric about zero (1 with fewer than two sequences or no
            nonzero gain).
        sequences: Number of validation sequences.
    """

    gain: float
    pvalue: float
    sequences: int

    @property
    def favours(self) -> bool:
        """Whether the gains are positive at the level :data:`EVIDENCE_LEVEL`."""
        return self.pvalue < EVIDENCE_LEVEL


def positionwise_evidence(
    train: MaskedSequences, val: MaskedSequences, max_order: int = 3
) -> PositionwiseEvidence:
    r"""Does a per-position standardisation help the closed-form model on validation data?

    Two AR(p) Gaussians are fitted on ``train`` with their order chosen on ``val``
    (:meth:`AutoregressiveGaussian.fit_selected_order`, no refit): one on the frames, one on
    the frames standardised by the per-position moments of ``train``
    (:func:`~iresflow.transforms.positionwise.positionwise_moments`), whose log-density
    includes the log-determinant of the standardisation. The paired per-sequence difference of
    their validation log-likelihoods is the evidence, tested by ranks, so that one sequence
    with a large gain or loss neither decides nor masks it (docs/math.md#positionwise-affine).

    Args:
        train: Training split (``x`` ``(B, N, D)``, ``mask`` ``(B, N)``).
        val: Validation split (same ``N`` and ``D``) with at least one real frame.
        max_order: Highest AR order :math:`P \ge 0`.

    Returns:
        The :class:`PositionwiseEvidence`.

    Example:
        >>> from iresflow.data.datasets import SequenceSplit
        >>> g = torch.Generator().manual_seed(0)
        >>> profile = torch.linspace(-3, 3, 6).view(1, 6, 1)  # a mean that depends on position
        >>> x = profile + 0.1 * torch.randn(60, 6, 1, generator=g)
        >>> full, jac = torch.ones(30, 6, dtype=torch.bool), torch.zeros(30)
        >>> positionwise_evidence(SequenceSplit(x[:30], full, jac),
        ...                       SequenceSplit(x[30:], full, jac)).favours
        True
    """
    features, length = train.x.shape[2], train.x.shape[1]
    mean, var = positionwise_moments(train.x.double(), train.mask)
    scale = var.sqrt()

    def standardised(split: MaskedSequences) -> _Sequences:
        x = (split.x.double() - mean) / scale
        return _Sequences(torch.where(split.mask.unsqueeze(-1), x, 0.0), split.mask)

    plain = AutoregressiveGaussian(features, length)  # fits and scores in float64
    plain.fit_selected_order(train, val, max_order, refit=False)
    val_standardised = standardised(val)
    per_position = AutoregressiveGaussian(features, length)
    per_position.fit_selected_order(standardised(train), val_standardised, max_order,
                                    refit=False)
    jacobian = torch.where(val.mask, -scale.log().sum(-1), 0.0).sum(-1)
    diff = (per_position.log_prob(*val_standardised) + jacobian
            - plain.log_prob(val.x, val.mask))
    count = diff.shape[0]
    informative = count > 1 and bool((diff != 0).any())
    pvalue = (float(stats.wilcoxon(diff.detach().cpu().numpy(), alternative="greater").pvalue)
              if informative else 1.0)
    return PositionwiseEvidence(float(diff.mean()), pvalue, count)
