"""Which sequences go to training, validation and test: the sizes of the splits, a seeded
random split, and a split of overlapping windows into blocks that share no frame.

The default validation fraction holds at least :data:`MIN_VAL_SEQUENCES` sequences of small
data (docs/datasets.md#validation-split).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "MAX_VAL_FRACTION", "MIN_VAL_SEQUENCES", "VAL_FRACTION", "blocked_split",
    "default_val_fraction", "random_split", "split_sizes",
]

#: Fraction of the sequences held out for validation when none is given, for data with at least
#: :data:`MIN_VAL_SEQUENCES` / ``VAL_FRACTION`` sequences (:func:`default_val_fraction`).
VAL_FRACTION = 0.1
#: Sequences the default validation split holds at least, where that takes at most
#: :data:`MAX_VAL_FRACTION` of the data: a tenth of a few dozen sequences is too few to choose the
#: best epoch and to stop early on.
MIN_VAL_SEQUENCES = 10
#: Largest fraction of the data the default validation split takes.
MAX_VAL_FRACTION = 0.25


def default_val_fraction(total: int) -> float:
    """The validation fraction used when none is given (docs/datasets.md#validation-split).

    :data:`VAL_FRACTION`, raised for small data so that the validation split holds
    :data:`MIN_VAL_SEQUENCES` sequences, but never above :data:`MAX_VAL_FRACTION`.

    Args:
        total: Number of sequences the validation split is drawn from (of weeks for
            ``co2_windows``), at least 1.

    Returns:
        The fraction, in ``[VAL_FRACTION, MAX_VAL_FRACTION]``.

    Example:
        >>> default_val_fraction(270), default_val_fraction(40), default_val_fraction(20)
        (0.1, 0.25, 0.25)
        >>> round(default_val_fraction(67) * 67)
        10
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"total must be an int >= 1, got {total!r}")
    return min(max(VAL_FRACTION, MIN_VAL_SEQUENCES / total), MAX_VAL_FRACTION)


def split_sizes(total: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """Sizes of the training, validation and test splits of ``total`` sequences: at least one
    for validation, one for test unless ``test_fraction`` is 0, the rest (at least 2) training.

    Raises:
        ValueError: fewer than two sequences left for training.

    Example:
        >>> split_sizes(100, 0.1, 0.1), split_sizes(20, 0.25, 0.0)
        ((80, 10, 10), (15, 5, 0))
    """
    n_val = max(1, round(val_fraction * total))
    n_test = max(1, round(test_fraction * total)) if test_fraction > 0 else 0
    n_train = total - n_val - n_test
    if n_train < 2:
        raise ValueError(
            f"{total} sequences are too few to split with val_fraction={val_fraction} and "
            f"test_fraction={test_fraction} (the training split needs at least 2)"
        )
    return n_train, n_val, n_test


def random_split(
    total: int, val_fraction: float, test_fraction: float, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """A random split of ``total`` sequences into the sizes of :func:`split_sizes`.

    Returns:
        The sorted int64 indices of the training, validation and test sequences.
    """
    n_train, n_val, _ = split_sizes(total, val_fraction, test_fraction)
    perm = torch.randperm(total, generator=generator)
    train, val, test = perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]
    return train.sort().values, val.sort().values, test.sort().values


def blocked_split(
    total: int, val_fraction: float, test_fraction: float, gap: int
) -> tuple[Tensor, Tensor, Tensor]:
    """A split of ``total`` windows in time order into blocks: training, then validation, then
    test, with ``gap`` windows left out before each later block.

    For overlapping windows cut from series (docs/datasets.md#validation-split): ``gap``
    windows, the number of later windows that still overlap one, keep every frame of a block
    out of the blocks before it. The sizes are those of :func:`split_sizes`, the training
    block giving up the gaps.

    Args:
        total: Number of windows, in the order of the series and of time within each.
        val_fraction: Fraction of ``total`` for validation.
        test_fraction: Fraction of ``total`` for test (0: none).
        gap: Windows dropped before the validation block and before the test block (>= 0).

    Returns:
        The sorted int64 indices of the training, validation and test windows.

    Raises:
        ValueError: ``gap < 0``, or fewer than two windows left for training.

    Example:
        >>> train, val, test = blocked_split(12, 0.25, 0.0, 2)
        >>> train.tolist(), val.tolist(), test.tolist()
        ([0, 1, 2, 3, 4, 5, 6], [9, 10, 11], [])
    """
    if isinstance(gap, bool) or not isinstance(gap, int) or gap < 0:
        raise ValueError(f"gap must be an int >= 0, got {gap!r}")
    _, n_val, n_test = split_sizes(total, val_fraction, test_fraction)
    gaps = gap * (1 + (n_test > 0))
    n_train = total - n_val - n_test - gaps
    if n_train < 2:
        raise ValueError(
            f"{total} overlapping windows are too few to split with val_fraction={val_fraction} "
            f"and test_fraction={test_fraction} after leaving out {gaps} windows that overlap "
            "the next block (the training split needs at least 2; a larger stride overlaps less)"
        )
    val_start = n_train + gap
    test_start = val_start + n_val + (gap if n_test > 0 else 0)
    return (torch.arange(n_train), torch.arange(val_start, val_start + n_val),
            torch.arange(test_start, test_start + n_test))
