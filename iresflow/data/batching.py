"""The minibatches of a training epoch: a seeded shuffle, optionally bucketed by length.

Without buckets an epoch is a random permutation of the sequences cut into batches. With
``bucket = k`` the permutation is cut into windows of ``k`` batches, each window is sorted by
sequence length and cut into batches, and the order of the batches is shuffled: a batch then
holds sequences of similar lengths, so little of it is padding, while every sequence is still
visited once per epoch in a random context. The same generator state gives the same batches on
every rank, which is what lets a data-parallel run shard them
(:func:`~iresflow.train.distributed.shard`) and resume them exactly (the generator's state is
part of every checkpoint).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["epoch_batches"]


def epoch_batches(
    frames: Tensor, batch_size: int, generator: torch.Generator, bucket: int = 0
) -> list[Tensor]:
    """The batches of one epoch: indices into a split, every sequence exactly once.

    Args:
        frames: Length of every sequence, shape ``(B,)``, integer.
        batch_size: Sequences per batch (the last batch of a window may be shorter).
        generator: CPU generator of the shuffles; advanced by the call.
        bucket: Batches per window sorted by length (0: no sorting, a plain random
            permutation cut into batches).

    Returns:
        ``ceil(B / batch_size)`` index tensors, int64.

    Raises:
        ValueError: ``frames`` not of shape ``(B,)``, ``batch_size < 1`` or ``bucket < 0``.

    Example:
        >>> frames = torch.tensor([1, 9, 2, 8])
        >>> batches = epoch_batches(frames, 2, torch.Generator().manual_seed(0), bucket=2)
        >>> sorted(sorted(frames[b].tolist()) for b in batches)
        [[1, 2], [8, 9]]
    """
    if not isinstance(frames, Tensor) or frames.dim() != 1:
        raise ValueError("frames must be a tensor of shape (B,)")
    for name, value, low in (("batch_size", batch_size, 1), ("bucket", bucket, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    order = torch.randperm(len(frames), generator=generator)
    if bucket == 0:
        return list(order.split(batch_size))
    batches = []
    for window in order.split(batch_size * bucket):
        by_length = window[torch.argsort(frames[window], stable=True)]
        batches.extend(by_length.split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
