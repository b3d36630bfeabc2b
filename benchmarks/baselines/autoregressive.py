r"""Sequence helpers of the baselines; the AR(p) Gaussian reference lives in the library.

The closed-form linear-Gaussian :math:`\mathrm{AR}(p)` model over frames that the results
tables report is :class:`iresflow.models.reference.AutoregressiveGaussian` (re-exported here for
the benchmark scripts): the same model ``iresflow evaluate`` can fit on a run's training split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from iresflow.models.reference import AutoregressiveGaussian

__all__ = ["AutoregressiveGaussian", "left_align"]


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
