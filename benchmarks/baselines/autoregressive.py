r"""Linear-Gaussian autoregressive model of order :math:`p` over frames, fitted in closed form.

Frames :math:`x_1,\dots,x_T\in\mathbb R^D` of a sequence (its real frames, in order) follow

.. math::

    x_t \mid x_{t-1},\dots,x_{t-k} \sim \mathcal N\!\big(A_k\,[x_{t-1};\dots;x_{t-k}] + b_k,\;
    S_k\big),\qquad k = \min(t-1,\,p),

so frame 1 has a full-covariance Gaussian (:math:`k=0`), frames :math:`t\le p` the
:math:`\mathrm{AR}(t-1)` conditional, and every later frame the :math:`\mathrm{AR}(p)` one.
Conditional :math:`k<p` is fitted on the :math:`(k+1)`-th frames of all sequences that long,
conditional :math:`p` on every frame with at least :math:`p` predecessors. Each fit is the
Gaussian maximum-likelihood estimate: least squares for :math:`(A_k, b_k)` and the (``1/M``)
residual covariance plus a ridge :math:`\lambda I` for :math:`S_k`. With :math:`p=0` the model
is the full-covariance Gaussian over i.i.d. frames
(:class:`~benchmarks.baselines.gaussian.FrameGaussian`). The log-density of a sequence is the sum
of its conditionals (change of variables to the standardised innovations
:math:`z_t = L_k^{-1}(x_t - A_k[\dots] - b_k)`, :math:`L_kL_k^\top = S_k`: see
``docs/math.md#change-of-variables``); padding never enters (``docs/math.md#masks``).

:meth:`AutoregressiveGaussian.fit_selected_order` chooses :math:`p\in\{0,\dots,P\}` by the
validation likelihood of fits on the training split, then refits the chosen order on training
and validation sequences together.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from benchmarks.baselines.gaussian import fit_gaussian
from iresflow._validation import check_mask, check_sequence
from iresflow.data.datasets import SequenceSplit
from iresflow.models.distributions import sample_mask

__all__ = ["AutoregressiveGaussian", "lagged", "left_align"]


def left_align(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Move the real frames of every sequence to its front, keeping their order.

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Padding mask ``(B, N)`` (``True`` = real) or ``None`` (all real).

    Returns:
        ``(x', mask')``: ``x'`` ``(B, N, D)`` with the real frames first and zeros after them,
        ``mask'`` ``(B, N)`` with ``mask'[b, t] = t < length_b``.

    Example:
        >>> x = torch.arange(3.0).reshape(1, 3, 1)
        >>> aligned, mask = left_align(x, torch.tensor([[False, True, True]]))
        >>> aligned.flatten().tolist(), mask.tolist()
        ([1.0, 2.0, 0.0], [[True, True, False]])
    """
    if mask is None:
        return x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)
    aligned = torch.gather(x, 1, order.unsqueeze(-1).expand_as(x))
    lengths = mask.sum(1, keepdim=True)
    new_mask = torch.arange(x.shape[1], device=x.device) < lengths
    return torch.where(new_mask.unsqueeze(-1), aligned, 0.0), new_mask


def lagged(x: Tensor, order: int) -> Tensor:
    r"""The :math:`p` previous frames of every position, zero before the start.

    Args:
        x: Left-aligned sequences ``(B, N, D)``.
        order: Number of lags :math:`p \ge 0`.

    Returns:
        ``(B, N, p D)``; block :math:`j` (``[..., (j-1) D : j D]``) at position :math:`t` is
        :math:`x_{t-j}` (zero for :math:`t-j<0`).

    Example:
        >>> lagged(torch.tensor([[[1.0], [2.0], [3.0]]]), 2)[0].tolist()
        [[0.0, 0.0], [1.0, 0.0], [2.0, 1.0]]
    """
    b, n, d = x.shape
    lags = [torch.cat([x.new_zeros(b, min(j, n), d), x[:, : max(n - j, 0)]], 1)
            for j in range(1, order + 1)]
    return torch.cat(lags, -1) if lags else x.new_zeros(b, n, 0)


class AutoregressiveGaussian(nn.Module):
    r"""Linear-Gaussian :math:`\mathrm{AR}(p)` model over the real frames of sequences.

    The fitted conditionals are float64 buffers, zero-padded to ``p`` lags: ``weight``
    ``(p+1, pD, D)`` (conditional :math:`k` uses its first :math:`kD` rows, :math:`A_k^\top`),
    ``bias`` ``(p+1, D)`` and ``scale_tril`` ``(p+1, D, D)`` (Cholesky factors of :math:`S_k`).

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

    def __init__(self, features: int, max_len: int, ridge: float = 1e-4) -> None:
        super().__init__()
        if features < 1 or max_len < 1:
            raise ValueError(f"features and max_len must be positive, got {features}, {max_len}")
        if ridge < 0 or not math.isfinite(ridge):
            raise ValueError(f"ridge must be a finite float >= 0, got {ridge}")
        self.features = features
        self.max_len = max_len
        self.ridge = ridge
        self.register_buffer("weight", torch.zeros(1, 0, features))
        self.register_buffer("bias", torch.zeros(1, features))
        self.register_buffer("scale_tril", torch.eye(features).unsqueeze(0))

    @property
    def order(self) -> int:
        """The order :math:`p` of the fit."""
        return self.weight.shape[0] - 1

    @property
    def num_parameters(self) -> int:
        r"""Free parameters: :math:`\sum_k (k D^2 + D + D(D+1)/2)`."""
        d, p = self.features, self.order
        return sum(k * d * d + d + d * (d + 1) // 2 for k in range(p + 1))

    def _check(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        check_sequence(x, "x", features=self.features, allow_2d=False)
        return left_align(x.to(self.bias.dtype), check_mask(mask, x))

    def fit(self, x: Tensor, mask: Tensor | None = None, order: int = 1) -> AutoregressiveGaussian:
        """Fit the :math:`\\mathrm{AR}(p)` conditionals on the real frames of ``x``.

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Padding mask ``(B, N)`` or ``None``.
            order: :math:`p \\ge 0`; the longest sequence needs more than :math:`p` frames.

        Returns:
            ``self``.

        Raises:
            ValueError: a bad ``order``, or no sequence longer than ``order``.
        """
        if isinstance(order, bool) or not isinstance(order, int) or order < 0:
            raise ValueError(f"order must be an int >= 0, got {order!r}")
        check_sequence(x, "x", features=self.features, allow_2d=False)
        x, mask = left_align(x.to(torch.float64), check_mask(mask, x))
        longest = int(mask.sum(1).max())
        if longest <= order:
            raise ValueError(f"an order-{order} model needs a sequence of at least {order + 1} "
                             f"real frames to fit its AR({order}) conditional; the longest has "
                             f"{longest}")
        d = self.features
        lags = lagged(x, order)
        weight = x.new_zeros(order + 1, order * d, d)
        bias = x.new_zeros(order + 1, d)
        tril = x.new_zeros(order + 1, d, d)
        positions = torch.arange(x.shape[1], device=x.device)
        for k in range(order + 1):
            rows = mask & ((positions == k) if k < order else (positions >= k))
            target = x[rows]
            design = torch.cat([lags[rows][:, : k * d],
                                target.new_ones(target.shape[0], 1)], 1)
            solution = torch.linalg.lstsq(design, target, driver="gelsd").solution
            mean, tril[k] = fit_gaussian(target - design @ solution, self.ridge)
            weight[k, : k * d] = solution[: k * d]
            bias[k] = solution[k * d] + mean  # the residual mean is 0 up to rounding
        self.weight, self.bias, self.scale_tril = weight, bias, tril
        return self

    def fit_selected_order(
        self, train: SequenceSplit, val: SequenceSplit, max_order: int = 3
    ) -> list[float]:
        """Choose the order on the validation split, then refit it on train and validation.

        Every order :math:`p = 0..P` is fitted on ``train`` and scored by its validation
        log-likelihood; the best order is refitted on the sequences of both splits.

        Args:
            train: Training split ``(B, N, D)``.
            val: Validation split (same ``N`` and ``D``).
            max_order: :math:`P \\ge 0`.

        Returns:
            The validation NLL (nats per real frame, model space) of every order ``0..P``.

        Example:
            >>> x = torch.randn(40, 8, 1, dtype=torch.float64).cumsum(1)  # a random walk: AR(1)
            >>> full = torch.ones(20, 8, dtype=torch.bool)
            >>> jac = torch.zeros(20, dtype=torch.float64)
            >>> model = AutoregressiveGaussian(1, max_len=8)
            >>> val_nll = model.fit_selected_order(SequenceSplit(x[:20], full, jac),
            ...                                    SequenceSplit(x[20:], full, jac))
            >>> model.order >= 1, val_nll[1] < val_nll[0], len(val_nll)
            (True, True, 4)
        """
        if isinstance(max_order, bool) or not isinstance(max_order, int) or max_order < 0:
            raise ValueError(f"max_order must be an int >= 0, got {max_order!r}")
        if train.x.shape[1:] != val.x.shape[1:]:
            raise ValueError(f"train and val must share (N, D), got {tuple(train.x.shape[1:])} "
                             f"and {tuple(val.x.shape[1:])}")
        frames = float(val.mask.sum())
        val_nll = []
        for order in range(max_order + 1):
            self.fit(train.x, train.mask, order)
            val_nll.append(-float(self.log_prob(val.x, val.mask).sum()) / frames)
        best = min(range(max_order + 1), key=val_nll.__getitem__)
        self.fit(torch.cat([train.x, val.x]), torch.cat([train.mask, val.mask]), best)
        return val_nll

    def _conditionals(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Means ``(B, N, D)`` and Cholesky factors ``(N, D, D)`` of left-aligned ``x``."""
        p = self.order
        which = torch.arange(x.shape[1], device=x.device).clamp(max=p)
        weight, bias = self.weight[which], self.bias[which]
        mean = torch.einsum("bnl,nld->bnd", lagged(x, p), weight) + bias
        return mean, self.scale_tril[which]

    def _innovations(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Standardised innovations ``(B, N, D)`` and ``log|det L|`` per position ``(N,)``."""
        mean, tril = self._conditionals(x)
        z = torch.linalg.solve_triangular(tril, (x - mean).unsqueeze(-1), upper=False)
        return z.squeeze(-1), tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-density ``(B,)`` of sequences ``x`` ``(B, N, D)``, summed over real frames.

        Computed in the dtype of the fitted buffers (float64 after :meth:`fit`).
        """
        x, mask = self._check(x, mask)
        z, log_det = self._innovations(x)
        per_frame = (-0.5 * z.square().sum(-1) - log_det
                     - 0.5 * self.features * math.log(2 * math.pi))
        return torch.where(mask, per_frame, 0.0).sum(-1)

    def transform_to_noise(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        r"""Standardised innovations :math:`z_t = L_k^{-1}(x_t - A_k[\dots] - b_k)`.

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Padding mask ``(B, N)`` or ``None``.

        Returns:
            ``z`` ``(B, N, D)`` at the positions of the real frames, ``x`` at padding.
        """
        check_sequence(x, "x", features=self.features, allow_2d=False)
        mask = check_mask(mask, x)
        aligned, aligned_mask = left_align(x.to(self.bias.dtype), mask)
        z = self._innovations(aligned)[0]
        if mask is None:
            return z
        out = x.to(z.dtype).clone()
        out[mask] = z[aligned_mask]  # real frames keep their order
        return out

    @torch.no_grad()
    def sample(
        self,
        num: int,
        seq_len: int | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Ancestral sampling: ``(x (num, N, D), mask (num, N))``, ``x`` zero at padding.

        Exactly one of ``seq_len`` (common length) and ``lengths`` (``(num,)`` integers).
        """
        mask = sample_mask(num, seq_len, lengths, self.max_len, self.bias.device)
        p, d = self.order, self.features
        eps = torch.randn(*mask.shape, d, generator=generator, device=self.bias.device,
                          dtype=self.bias.dtype)
        x = eps.new_zeros(eps.shape)
        for t in range(mask.shape[1]):
            k = min(t, p)
            past = x[:, max(t - k, 0) : t].flip(1).reshape(num, k * d)
            mean = past @ self.weight[k, : k * d] + self.bias[k]
            x[:, t] = mean + eps[:, t] @ self.scale_tril[k].T
        return torch.where(mask.unsqueeze(-1), x, 0.0), mask
