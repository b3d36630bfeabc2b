r"""Base distributions of sequence flows and the padding masks of samples.

:class:`SequenceBase` is the contract of the density of a flow's noise over the real frames
(docs/math.md#masks); :class:`StandardNormalSequence` is the default one. :func:`sample_mask`
builds the padding mask of sequences to sample.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
from torch import Tensor, nn

from iresflow._validation import check_float, check_generator, check_int, check_sequence

__all__ = ["SequenceBase", "StandardNormalSequence", "sample_mask"]


class SequenceBase(nn.Module, ABC):
    r"""The density of the noise of a :class:`~iresflow.models.flow.SequenceFlow`.

    A distribution of sequences ``(B, N, D)`` with ``D = features`` whose density covers the
    real frames only: padded frames never enter :meth:`log_prob`, and :meth:`sample` returns
    zeros there. ``context`` is the context vector ``(B, C)`` of a conditional flow (the output
    of its context encoder, ``None`` for an unconditional flow); a base that does not depend on
    it ignores it, as nflows' distributions do. The flow validates its inputs before calling
    the base, so implementations need not.

    Subclasses set :attr:`features` and implement :meth:`log_prob` and :meth:`sample`.
    """

    #: Feature size ``D`` of every frame.
    features: int

    @abstractmethod
    def log_prob(
        self, z: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """Log-density of every sequence, summed over its real frames.

        Args:
            z: Noise ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real frames.
            context: Context vector ``(B, C)`` of a conditional flow, or ``None``.

        Returns:
            Shape ``(B,)``.
        """

    @abstractmethod
    def sample(
        self,
        mask: Tensor,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        *,
        context: Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Draw noise on the real frames of ``mask``, zeros at padding.

        Args:
            mask: Boolean padding mask ``(B, N)``; the noise is drawn on its device.
            generator: The only source of randomness (torch's global generator when ``None``).
            temperature: Spread :math:`T > 0` of the draw relative to the density (1: the
                density itself; the standard deviation of Gaussian noise is multiplied by
                :math:`T`).
            context: Context vector ``(B, C)`` of a conditional flow, or ``None``.
            dtype: Floating dtype of the noise (a flow passes that of its parameters).

        Returns:
            Noise of shape ``(B, N, D)``.
        """


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
        z = check_sequence(z, "z", features=self.features, allow_2d=False)
        per_frame = -0.5 * z.square().sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
        if mask is not None:
            per_frame = torch.where(mask, per_frame, 0.0)
        return per_frame.sum(-1)

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
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
            raise TypeError("mask must be a boolean torch.Tensor of shape (B, N)")
        generator = check_generator(generator)
        temperature = check_float(temperature, "temperature", 0.0)
        z = torch.randn(*mask.shape, self.features, generator=generator, device=mask.device,
                        dtype=dtype) * temperature
        return torch.where(mask.unsqueeze(-1), z, 0.0)

    def extra_repr(self) -> str:
        return f"features={self.features}"


def sample_mask(
    num: int, seq_len: int | None, lengths: Tensor | None, max_len: int | None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Padding mask for ``num`` sequences to sample, from a common length or per-sample lengths.

    Args:
        num: Number of sequences, ``>= 1``.
        seq_len: Common length in ``[1, max_len]``; exclusive with ``lengths``.
        lengths: Per-sample lengths, integer tensor ``(num,)`` with values in ``[1, max_len]``.
        max_len: Longest length the model accepts (``None``: unbounded).
        device: Device of the returned mask.

    Returns:
        Boolean mask ``(num, N)`` (``True`` = real token), ``N = seq_len`` or ``max(lengths)``.

    Raises:
        ValueError: neither or both of ``seq_len`` and ``lengths``, or lengths out of range.
        TypeError: ``num`` or ``seq_len`` is not an int, or ``lengths`` is not an integer tensor.

    Example:
        >>> sample_mask(2, None, torch.tensor([1, 3]), 4).int().tolist()
        [[1, 0, 0], [1, 1, 1]]
    """
    num = check_int(num, "num", 1)
    longest = math.inf if max_len is None else max_len
    if (seq_len is None) == (lengths is None):
        raise ValueError("give exactly one of seq_len and lengths")
    if lengths is None:
        seq_len = check_int(seq_len, "seq_len", 1)
        if seq_len > longest:
            raise ValueError(f"seq_len must be <= max_len={max_len}, got {seq_len}")
        return torch.ones(num, seq_len, dtype=torch.bool, device=device)
    if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point or (
        lengths.dtype in (torch.bool, torch.complex64, torch.complex128)
    ):
        raise TypeError("lengths must be an integer torch.Tensor of shape (num,)")
    if lengths.shape != (num,):
        raise ValueError(f"lengths must have shape (num,) = ({num},), got {tuple(lengths.shape)}")
    if bool((lengths < 1).any()) or bool((lengths > longest).any()):
        raise ValueError(f"lengths must lie in [1, max_len={max_len}]")
    lengths = lengths.to(device)
    return torch.arange(int(lengths.max()), device=lengths.device) < lengths.unsqueeze(1)
