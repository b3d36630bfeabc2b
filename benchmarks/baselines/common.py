"""Helpers shared by the baseline models: sampling masks and masked Gaussian log-densities."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["masked_normal_log_prob", "sample_lengths_mask"]


def sample_lengths_mask(
    num: int,
    seq_len: int | None,
    lengths: Tensor | None,
    max_len: int,
    device: torch.device | str | None = None,
) -> Tensor:
    r"""Padding mask for ``num`` sampled sequences.

    Args:
        num: Number of sequences to sample, ``> 0``.
        seq_len: Common length of all samples (``None``: ``max_len`` unless ``lengths`` given).
        lengths: Optional per-sample lengths, integer tensor of shape ``(num,)`` with values in
            ``[1, max_len]``; mutually exclusive with ``seq_len``.
        max_len: Largest length the model supports.
        device: Device of the returned mask.

    Returns:
        Boolean mask of shape ``(num, N)`` (``True`` = real token), ``N = max(lengths)`` or
        ``seq_len``.

    Raises:
        ValueError: ``num`` not positive, both or invalid lengths.
        TypeError: ``lengths`` is not an integer tensor.

    Example:
        >>> sample_lengths_mask(2, None, torch.tensor([1, 3]), 4).int().tolist()
        [[1, 0, 0], [1, 1, 1]]
    """
    if not isinstance(num, int) or num <= 0:
        raise ValueError(f"num must be a positive int, got {num!r}")
    if seq_len is not None and lengths is not None:
        raise ValueError("give at most one of seq_len and lengths")
    if lengths is None:
        n = max_len if seq_len is None else seq_len
        if not isinstance(n, int) or not 1 <= n <= max_len:
            raise ValueError(f"seq_len must be an int in [1, {max_len}], got {seq_len!r}")
        return torch.ones(num, n, dtype=torch.bool, device=device)
    if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point or lengths.dtype == (
        torch.bool
    ):
        raise TypeError("lengths must be an integer torch.Tensor of shape (num,)")
    if lengths.shape != (num,):
        raise ValueError(f"lengths must have shape ({num},), got {tuple(lengths.shape)}")
    if bool((lengths < 1).any()) or bool((lengths > max_len).any()):
        raise ValueError(f"lengths must lie in [1, {max_len}]")
    n = int(lengths.max())
    positions = torch.arange(n, device=lengths.device)
    return (positions[None, :] < lengths[:, None]).to(device)


def masked_normal_log_prob(z: Tensor, mask: Tensor | None) -> Tensor:
    r"""Standard-normal log-density of the real tokens of a batch of sequences.

    .. math:: \log p(Z) = \sum_{i\,:\,m_i=1} \Big(-\tfrac12\|z_i\|^2 - \tfrac D2\log 2\pi\Big).

    Args:
        z: Sequences, shape ``(B, N, D)``.
        mask: Optional boolean mask ``(B, N)``, ``True`` for real tokens.

    Returns:
        Log-densities, shape ``(B,)``.

    Example:
        >>> mask = torch.tensor([[True, False]])
        >>> round(float(masked_normal_log_prob(torch.zeros(1, 2, 1), mask)), 6)  # log N(0; 0, 1)
        -0.918939
    """
    per_token = -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
    if mask is not None:
        per_token = per_token * mask.to(per_token.dtype)
    return per_token.sum(-1)
