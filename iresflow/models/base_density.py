r"""The contract of a flow's base density, and the padding mask of the sequences it draws.

:class:`SequenceBase` is the contract of the density of a flow's noise over the real frames
(docs/math.md#masks), with the per-frame split and the conditional draw a causal flow scores
and forecasts with (docs/forecasting.md); :func:`sample_mask` builds the padding mask of
sequences to sample. The densities themselves are in :mod:`iresflow.models.distributions`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
from torch import Tensor, nn

from iresflow._validation import check_int

__all__ = ["SequenceBase", "sample_mask"]


class SequenceBase(nn.Module, ABC):
    r"""The density of the noise of a :class:`~iresflow.models.flow.SequenceFlow`.

    A distribution of sequences ``(B, N, D)`` with ``D = features`` whose density covers the
    real frames only: padded frames never enter :meth:`log_prob`, and :meth:`sample` returns
    zeros there. ``context`` is the context vector ``(B, C)`` of a conditional flow (the output
    of its context encoder, ``None`` for an unconditional flow); a base that does not depend on
    it ignores it, as nflows' distributions do. The flow validates its inputs once, at its
    door, before calling the base: :meth:`log_prob` trusts its caller and checks nothing.

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

    def frame_log_prob(
        self, z: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        r"""Log-density of every real frame's noise given the earlier real frames',
        :math:`\log p(z_t \mid z_{<t})` (docs/forecasting.md#frame-scores).

        Summed over the frames it is :meth:`log_prob`.

        Args:
            z: Noise ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real frames.
            context: Context vector ``(B, C)`` of a conditional flow, or ``None``.

        Returns:
            Shape ``(B, N)``, zero at padded frames.

        Raises:
            NotImplementedError: the base does not split its density by frames (the default
                for a base registered from outside that does not implement it).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not split its density by frames: implement "
            f"frame_log_prob to score frames with it"
        )

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
        r"""Draw the noise of the new frames given that of the observed ones
        (docs/forecasting.md#conditional-noise).

        The frames of ``mask`` that ``observed`` does not hold are drawn from the density of
        their noise conditioned on ``z`` at the ``observed`` frames (a forecast of a causal flow
        draws its future noise so); the observed frames are returned as they are and every other
        frame is zero. The flow checks the arguments; this method trusts them.

        Args:
            z: Noise ``(B, N, D)``, read at the ``observed`` frames only.
            observed: Boolean mask ``(B, N)`` of the frames whose noise is given.
            mask: Boolean mask ``(B, N)`` of all real frames (observed and new).
            generator: The only source of randomness (torch's global generator when ``None``).
            temperature: Spread :math:`T > 0` of the draw, as in :meth:`sample`.
            context: Context vector ``(B, C)`` of a conditional flow, or ``None``.

        Returns:
            Noise ``(B, N, D)``.

        Raises:
            NotImplementedError: the base has no conditional draw (the default for a base
                registered from outside that does not implement it).
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no conditional draw given observed frames: implement "
            f"sample_given to forecast with it"
        )

    def given_scale(self, z: Tensor, observed: Tensor) -> Tensor:
        r"""The scale of the noise of new frames given the noise ``z`` of the observed frames,
        relative to the scale of an unconditional draw (docs/forecasting.md#conditional-noise).

        1 where the frames are independent; above 1 where the observed noise makes the base
        expect a louder sequence than usual (a sequence-level t after surprising frames), so
        that every forecast drawn from it spreads wider.

        Args:
            z: Noise ``(B, N, D)``, read at the ``observed`` frames only.
            observed: Boolean mask ``(B, N)`` of the frames whose noise is given.

        Returns:
            Shape ``(B,)``.

        Raises:
            NotImplementedError: the base does not report it (the default for a base
                registered from outside that does not implement it).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not report the scale of its conditional draw: "
            f"implement given_scale"
        )

    def sample_new(
        self,
        z: Tensor,
        observed: Tensor,
        mask: Tensor,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        *,
        context: Tensor | None = None,
    ) -> Tensor:
        r"""Draw the noise of the new frames from the base's own density of them, whatever the
        noise of the observed ones (docs/forecasting.md#conditional-noise).

        A fresh draw of :meth:`sample` at the frames of ``mask`` that ``observed`` does not
        hold; the observed frames are returned as they are and every other frame is zero. For a
        base whose frames are independent this is :meth:`sample_given`; for one that ties them
        (a sequence-level t) it leaves out what the observed noise says about the new frames'
        scale (a forecast with ``noise = "prior"``). The arguments are those of
        :meth:`sample_given` (``z`` ``(B, N, D)``, the masks ``(B, N)``).

        Returns:
            Noise ``(B, N, D)``.
        """
        new = self.sample(mask & ~observed, generator, temperature, context=context,
                          dtype=z.dtype)
        return torch.where(observed.unsqueeze(-1), z, new)


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
