"""The padding mask of sampled sequences, shared by the baseline models."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sample_mask"]


def sample_mask(
    num: int,
    seq_len: int | None,
    lengths: Tensor | None,
    max_len: int,
    device: torch.device | str | None = None,
) -> Tensor:
    r"""Padding mask for ``num`` sequences to sample, from a common length or per-sample lengths.

    Same convention as ``ResidualFlowTransformer.sample``: exactly one of ``seq_len`` and
    ``lengths``.

    Args:
        num: Number of sequences, ``> 0``.
        seq_len: Common length of all samples, in ``[1, max_len]``.
        lengths: Per-sample lengths, integer tensor of shape ``(num,)`` with values in
            ``[1, max_len]``.
        max_len: Longest length the model supports.
        device: Device of the returned mask.

    Returns:
        Boolean mask of shape ``(num, N)`` (``True`` = real token), ``N = seq_len`` or
        ``max(lengths)``.

    Raises:
        ValueError: ``num`` not positive, neither or both of ``seq_len``/``lengths``, or lengths
            outside ``[1, max_len]``.
        TypeError: ``lengths`` is not an integer tensor.

    Example:
        >>> sample_mask(2, None, torch.tensor([1, 3]), 4).int().tolist()
        [[1, 0, 0], [1, 1, 1]]
    """
    if isinstance(num, bool) or not isinstance(num, int) or num <= 0:
        raise ValueError(f"num must be a positive int, got {num!r}")
    if (seq_len is None) == (lengths is None):
        raise ValueError("give exactly one of seq_len and lengths")
    if lengths is None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= max_len:
            raise ValueError(f"seq_len must be an int in [1, {max_len}], got {seq_len!r}")
        return torch.ones(num, seq_len, dtype=torch.bool, device=device)
    if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point or lengths.dtype in (
        torch.bool, torch.complex64, torch.complex128
    ):
        raise TypeError("lengths must be an integer torch.Tensor of shape (num,)")
    if lengths.shape != (num,):
        raise ValueError(f"lengths must have shape ({num},), got {tuple(lengths.shape)}")
    if bool((lengths < 1).any()) or bool((lengths > max_len).any()):
        raise ValueError(f"lengths must lie in [1, {max_len}]")
    positions = torch.arange(int(lengths.max()), device=lengths.device)
    return (positions[None, :] < lengths[:, None]).to(device)
