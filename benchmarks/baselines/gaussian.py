r"""Full-covariance Gaussian baselines fitted in closed form.

Two models, both maximum-likelihood fits on the training split with a small ridge on the
covariance diagonal:

* :class:`FrameGaussian` treats the real frames of every sequence as i.i.d. draws of one
  :math:`D`-dimensional Gaussian,
  :math:`\log p(X) = \sum_{i\,:\,m_i=1}\log\mathcal N(x_i;\mu,\Sigma)`.
* :class:`SequenceGaussian` models the flattened sequence :math:`\mathrm{vec}(X)\in\mathbb R^{ND}`
  with one :math:`ND`-dimensional Gaussian (fixed-length data only).

MLE: :math:`\hat\mu = \frac1M\sum_m v_m`,
:math:`\hat\Sigma = \frac1M\sum_m (v_m-\hat\mu)(v_m-\hat\mu)^\top + \lambda I`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from iresflow.models.distributions import sample_mask

__all__ = ["FrameGaussian", "SequenceGaussian", "fit_gaussian"]


def fit_gaussian(v: Tensor, ridge: float = 1e-4) -> tuple[Tensor, Tensor]:
    r"""Closed-form maximum-likelihood Gaussian with a ridge.

    Args:
        v: Observations, shape ``(M, d)`` with ``M >= 1``.
        ridge: :math:`\lambda \ge 0` added to the diagonal of the (biased, ``1/M``) covariance.

    Returns:
        ``(mean (d,), scale_tril (d, d))`` with ``scale_tril`` the Cholesky factor of
        :math:`\hat\Sigma`.

    Example:
        >>> mean, tril = fit_gaussian(torch.tensor([[0.0], [2.0]]), ridge=0.0)
        >>> mean.tolist(), tril.tolist()
        ([1.0], [[1.0]])
    """
    if v.dim() != 2 or v.shape[0] == 0:
        raise ValueError(f"v must have shape (M, d) with M >= 1, got {tuple(v.shape)}")
    if ridge < 0 or not math.isfinite(ridge):
        raise ValueError(f"ridge must be a finite float >= 0, got {ridge}")
    mean = v.mean(0)
    centred = v - mean
    cov = centred.T @ centred / v.shape[0]
    cov = cov + ridge * torch.eye(v.shape[1], dtype=v.dtype, device=v.device)
    return mean, torch.linalg.cholesky(cov)


class _GaussianBase(nn.Module):
    """Shared storage: a mean and a Cholesky factor held as buffers (fitted, not trained)."""

    def __init__(self, dim: int, ridge: float) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dimension must be positive, got {dim}")
        self.ridge = ridge
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("scale_tril", torch.eye(dim))

    @property
    def num_parameters(self) -> int:
        """Free parameters of the fit: mean (d) and symmetric covariance (d (d + 1) / 2)."""
        d = self.mean.numel()
        return d + d * (d + 1) // 2

    def _set(self, v: Tensor) -> None:
        mean, tril = fit_gaussian(v, self.ridge)
        self.mean = mean
        self.scale_tril = tril

    def _log_density(self, v: Tensor) -> Tensor:
        dist = torch.distributions.MultivariateNormal(
            self.mean.to(v.dtype), scale_tril=self.scale_tril.to(v.dtype)
        )
        return dist.log_prob(v)

    def _draw(self, shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
        eps = torch.randn(
            *shape, self.mean.numel(), generator=generator, device=self.mean.device,
            dtype=self.mean.dtype,
        )
        return self.mean + eps @ self.scale_tril.T


class FrameGaussian(_GaussianBase):
    r"""One full-covariance Gaussian shared by all frames, frames i.i.d.

    Args:
        features: Frame size :math:`D`.
        max_len: Longest sequence :meth:`sample` may produce.
        ridge: Diagonal ridge :math:`\lambda` of the covariance.

    Example:
        >>> x = torch.randn(16, 5, 2)
        >>> model = FrameGaussian(2, max_len=5).fit(x)
        >>> samples, mask = model.sample(3, lengths=torch.tensor([5, 2, 4]))
        >>> model.log_prob(x).shape, samples.shape, samples[1, 2:].abs().sum().item()
        (torch.Size([16]), torch.Size([3, 5, 2]), 0.0)
    """

    def __init__(self, features: int, max_len: int, ridge: float = 1e-4) -> None:
        super().__init__(features, ridge)
        self.features = features
        self.max_len = max_len

    def fit(self, x: Tensor, mask: Tensor | None = None) -> FrameGaussian:
        """Fit on the real frames of ``x`` (B, N, D) in closed form; returns ``self``."""
        frames = x.reshape(-1, self.features) if mask is None else x[mask]
        self._set(frames)
        return self

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-density (B,) of sequences ``x`` (B, N, D), summed over real frames."""
        per_frame = self._log_density(x)
        if mask is not None:
            per_frame = per_frame * mask.to(per_frame.dtype)
        return per_frame.sum(-1)

    @torch.no_grad()
    def sample(
        self,
        num: int,
        seq_len: int | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Draw ``num`` sequences: ``(x (num, N, D), mask (num, N))``, ``x`` zero at padding.

        Exactly one of ``seq_len`` (common length) and ``lengths`` (``(num,)`` integers).
        """
        mask = sample_mask(num, seq_len, lengths, self.max_len, self.mean.device)
        x = self._draw(tuple(mask.shape), generator)
        return x * mask[..., None].to(x.dtype), mask


class SequenceGaussian(_GaussianBase):
    r"""One full-covariance Gaussian over :math:`\mathrm{vec}(X)\in\mathbb R^{ND}`.

    Args:
        seq_len: Fixed sequence length :math:`N`.
        features: Frame size :math:`D`.
        ridge: Diagonal ridge :math:`\lambda` of the covariance.

    Example:
        >>> x = torch.randn(32, 3, 2)
        >>> model = SequenceGaussian(3, 2).fit(x)
        >>> model.log_prob(x).shape, model.sample(4, seq_len=3)[0].shape
        (torch.Size([32]), torch.Size([4, 3, 2]))
    """

    def __init__(self, seq_len: int, features: int, ridge: float = 1e-4) -> None:
        super().__init__(seq_len * features, ridge)
        self.seq_len = seq_len
        self.features = features

    def _flatten(self, x: Tensor, mask: Tensor | None) -> Tensor:
        if x.shape[1:] != (self.seq_len, self.features):
            raise ValueError(f"x must have shape (B, {self.seq_len}, {self.features}), got "
                             f"{tuple(x.shape)}")
        if mask is not None and not bool(mask.all()):
            raise ValueError("SequenceGaussian models fixed-length data: mask must be all True")
        return x.reshape(x.shape[0], -1)

    def fit(self, x: Tensor, mask: Tensor | None = None) -> SequenceGaussian:
        """Fit on flattened sequences ``x`` (B, N, D) in closed form; returns ``self``."""
        self._set(self._flatten(x, mask))
        return self

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-density (B,) of sequences ``x`` (B, N, D)."""
        return self._log_density(self._flatten(x, mask))

    @torch.no_grad()
    def sample(
        self,
        num: int,
        seq_len: int | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Draw ``num`` sequences of length ``seq_len = N``: ``(x (num, N, D), mask (num, N))``."""
        mask = sample_mask(num, seq_len, lengths, self.seq_len, self.mean.device)
        if mask.shape[1] != self.seq_len or not bool(mask.all()):
            raise ValueError(f"SequenceGaussian only samples length {self.seq_len}")
        return self._draw((num,), generator).reshape(num, self.seq_len, self.features), mask
