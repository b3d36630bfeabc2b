r"""Activation normalisation for sequences (MATH.md G9; Kingma & Dhariwal, 2018)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from iresflow._validation import check_int
from iresflow.transforms.base import LogDetRequest, SequenceTransform

__all__ = ["ActNorm"]

#: Variance floor of the data-dependent initialisation (MATH.md G9).
MIN_INIT_VARIANCE = 0.2


class ActNorm(SequenceTransform):
    r"""Per-feature affine map shared over positions, with data-dependent initialisation.

    For every real token :math:`x_i \in \mathbb R^D` of a sequence (MATH.md G9),

    .. math::
        y_i = (x_i + b) \odot e^{s}, \qquad x_i = y_i \odot e^{-s} - b, \qquad
        \log|\det J| = n \sum_{d=1}^{D} s_d ,

    where :math:`n` is the number of real tokens of the sequence. Padded tokens (``mask``
    ``False``) are returned unchanged and do not enter the log-determinant. A ``(B, D)`` batch of
    vectors is treated as sequences of length 1.

    Initialisation: the first forward (data to noise) in training mode sets, from the real tokens
    of that batch only, :math:`b = -\mathrm{mean}` and
    :math:`s = -\tfrac12 \log \max(\mathrm{var}, 0.2)` per feature (biased variance), so that the
    outputs have zero mean and unit variance unless the variance floor applies. This is the one
    in-forward state change of the library; it runs under ``torch.no_grad`` and is recorded in the
    boolean buffer ``initialized``, which is part of the ``state_dict`` so that a loaded model is
    not re-initialised. In evaluation mode, or in :meth:`inverse`, no initialisation happens.

    ``forward``/``inverse`` are those of :class:`~iresflow.transforms.base.SequenceTransform`
    (``inputs (B, N, D)`` or ``(B, D)``, optional ``mask (B, N)``, ``logdet``); the context is
    ignored.

    Args:
        features: Feature size ``D``.

    Example:
        >>> actnorm = ActNorm(3)
        >>> x = torch.randn(4, 5, 3) * 2 + 1
        >>> y, logabsdet = actnorm(x)
        >>> bool(actnorm.initialized), y.shape, logabsdet.shape
        (True, torch.Size([4, 5, 3]), torch.Size([4]))
        >>> torch.allclose(actnorm.inverse(y)[0], x, atol=1e-5)
        True
    """

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.shift = nn.Parameter(torch.zeros(self.features))
        self.log_scale = nn.Parameter(torch.zeros(self.features))
        self.register_buffer("initialized", torch.tensor(False))
        # Host-side mirror of the buffer, so that forward never synchronises with the device.
        self._initialized = False
        self.register_load_state_dict_post_hook(_sync_initialized)

    @property
    def is_initialized(self) -> bool:
        """Whether the data-dependent initialisation has happened (read without a host sync)."""
        return self._initialized

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Data to noise, :math:`y = (x + b)\odot e^{s}` on real tokens (initialises first)."""
        if self.training and not self._initialized:
            self._initialize(inputs, mask)
        outputs = (inputs + self.shift) * torch.exp(self.log_scale)
        return self._finish(inputs, outputs, mask, self.log_scale.sum(), logdet)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Noise to data, :math:`x = y \odot e^{-s} - b` on real tokens."""
        outputs = inputs * torch.exp(-self.log_scale) - self.shift
        return self._finish(inputs, outputs, mask, -self.log_scale.sum(), logdet)

    @staticmethod
    def _finish(
        inputs: Tensor,
        outputs: Tensor,
        mask: Tensor | None,
        logdet_per_token: Tensor,
        logdet: LogDetRequest,
    ) -> tuple[Tensor, Tensor | None]:
        batch = inputs.shape[0]
        if mask is not None:
            outputs = torch.where(mask.unsqueeze(-1), outputs, inputs)
        if logdet is False:
            return outputs, None
        if mask is None:
            tokens = inputs.shape[1] if inputs.dim() == 3 else 1
            return outputs, logdet_per_token.expand(batch) * tokens
        return outputs, mask.sum(dim=1).to(outputs.dtype) * logdet_per_token

    @torch.no_grad()
    def _initialize(self, inputs: Tensor, mask: Tensor | None) -> None:
        frames = inputs.reshape(-1, self.features) if mask is None else inputs[mask]
        mean = frames.mean(dim=0)
        variance = (frames - mean).square().mean(dim=0)
        self.shift.copy_(-mean)
        self.log_scale.copy_(-0.5 * torch.log(variance.clamp_min(MIN_INIT_VARIANCE)))
        self.initialized.fill_(True)
        self._initialized = True

    def extra_repr(self) -> str:
        return f"features={self.features}"


def _sync_initialized(module: nn.Module, incompatible_keys: object) -> None:
    """Mirror the loaded ``initialized`` buffer into the host-side flag."""
    module._initialized = bool(module.initialized)
