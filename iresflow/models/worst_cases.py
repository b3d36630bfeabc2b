r"""The per-sequence NLL distribution of a split: median, worst, and sequences far above.

An average NLL can hide a model that is catastrophically wrong on a few sequences (one sequence
at thousands of nats per frame moves a mean over 40 sequences by a hundred). The summary here
reports the distribution's median, its worst sequence and how many sequences lie *far above
the median*, defined so that it works for negative NLLs too (densities above 1 in continuous
units, where "ten times the median" means nothing): sequence :math:`b` is far above when

.. math::

    \mathrm{nll}_b > \mathrm{median} + \max(k \cdot \mathrm{IQR},\; g),

with the inter-quartile range :math:`\mathrm{IQR} = q_{0.75} - q_{0.25}` (linear interpolation
between order statistics), :math:`k` = ``iqr_multiple`` (10 by default; Tukey's "far out" fence
is :math:`q_{0.75} + 3\,\mathrm{IQR}`, so this is a much wider one) and the absolute gap
:math:`g` = ``min_gap`` (1 unit, i.e. 1 nat/frame: a density :math:`e` times smaller per
frame), which keeps a very tight distribution from flagging small deviations
(docs/small_data.md#worst-cases).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["NLLDistribution", "summarize_sequence_nll"]


@dataclass(frozen=True)
class NLLDistribution:
    """Summary of per-sequence NLLs (in the unit of the values, e.g. nats/frame).

    Attributes:
        sequences: Number of sequences.
        median: Median NLL.
        iqr: Inter-quartile range.
        worst: Largest NLL.
        worst_index: Position of the worst sequence in the split.
        threshold: ``median + max(iqr_multiple * iqr, min_gap)``.
        far_above: Number of sequences with an NLL above ``threshold``.
        far_above_indices: Their positions, worst first.
    """

    sequences: int
    median: float
    iqr: float
    worst: float
    worst_index: int
    threshold: float
    far_above: int
    far_above_indices: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-serialisable dict (indices as a list)."""
        record = asdict(self)
        record["far_above_indices"] = list(self.far_above_indices)
        return record


def summarize_sequence_nll(
    nll: Tensor, *, iqr_multiple: float = 10.0, min_gap: float = 1.0
) -> NLLDistribution:
    """Median, worst and far-above-the-median count of per-sequence NLLs.

    Args:
        nll: Per-sequence NLLs ``(B,)`` with ``B >= 1``, finite (e.g.
            :meth:`~iresflow.data.datasets.SequenceDataset.sequence_nll`).
        iqr_multiple: :math:`k \\ge 0`, the fence's distance from the median in IQRs.
        min_gap: :math:`g \\ge 0`, the fence's smallest distance from the median.

    Returns:
        An :class:`NLLDistribution`.

    Raises:
        TypeError: ``nll`` is not a real tensor.
        ValueError: ``nll`` is not ``(B,)`` with ``B >= 1`` and finite values, or a negative or
            non-finite ``iqr_multiple`` or ``min_gap``.

    Example:
        >>> nll = torch.tensor([7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 467.0, 3788.0])
        >>> summary = summarize_sequence_nll(nll)
        >>> summary.median, summary.iqr, summary.threshold, summary.far_above_indices
        (11.5, 4.5, 56.5, (9, 8))
    """
    if not isinstance(nll, Tensor) or not (nll.is_floating_point() or nll.dtype == torch.long):
        raise TypeError(f"nll must be a real tensor of shape (B,), got {type(nll).__name__}")
    if nll.dim() != 1 or nll.numel() == 0:
        raise ValueError(f"nll must have shape (B,) with B >= 1, got {tuple(nll.shape)}")
    for name, value in (("iqr_multiple", iqr_multiple), ("min_gap", min_gap)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
    values = nll.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("nll must be finite")
    q1, median, q3 = torch.quantile(values, values.new_tensor([0.25, 0.5, 0.75])).tolist()
    threshold = median + max(iqr_multiple * (q3 - q1), min_gap)
    order = torch.argsort(values, descending=True, stable=True)
    far = order[values[order] > threshold]
    return NLLDistribution(
        sequences=values.numel(), median=median, iqr=q3 - q1, worst=float(values[order[0]]),
        worst_index=int(order[0]), threshold=threshold, far_above=far.numel(),
        far_above_indices=tuple(far.tolist()),
    )
