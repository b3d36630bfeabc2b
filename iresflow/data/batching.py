"""The minibatches of a training epoch: a seeded shuffle, optionally bucketed by length.

Without buckets an epoch is a random permutation of the sequences cut into batches. With
``bucket = k`` the permutation is cut into windows of ``k`` batches, each window is sorted by
sequence length and cut into batches, and the order of the batches is shuffled: a batch then
holds sequences of similar lengths, so little of it is padding, while every sequence is still
visited once per pass in a random context. A small training split can be passed over several
times in one epoch (``min_steps``), each pass a fresh shuffle, so that an epoch of a few dozen
sequences still holds enough optimiser steps between two validations. The same generator state
gives the same batches on every rank, which is what lets a data-parallel run shard them
(:func:`~iresflow.train.distributed.shard`) and resume them exactly (the generator's state is
part of every checkpoint).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["epoch_batches", "epoch_steps"]


def epoch_steps(sequences: int, batch_size: int, min_steps: int = 1) -> int:
    """Optimiser steps of an epoch: whole passes of ``ceil(sequences / batch_size)`` batches,
    as few as reach ``min_steps``.

    Args:
        sequences: Training sequences ``B`` (at least 1).
        batch_size: Sequences per batch.
        min_steps: Fewest steps of an epoch (1: one pass).

    Returns:
        The number of batches :func:`epoch_batches` returns for these settings.

    Raises:
        ValueError: an argument is not an int >= 1.

    Example:
        >>> epoch_steps(30, 32, 16), epoch_steps(50, 32, 16), epoch_steps(243, 32, 16)
        (16, 16, 16)
        >>> epoch_steps(90, 32, 16), epoch_steps(1000, 32, 16)
        (18, 32)
    """
    for name, value in (("sequences", sequences), ("batch_size", batch_size),
                        ("min_steps", min_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    per_pass = -(-sequences // batch_size)
    return per_pass * -(-min_steps // per_pass)


def epoch_batches(
    frames: Tensor, batch_size: int, generator: torch.Generator, bucket: int = 0,
    min_steps: int = 1,
) -> list[Tensor]:
    """The batches of one epoch: indices into a split, every sequence once per pass, in as
    many passes as reach ``min_steps`` batches (:func:`epoch_steps`).

    Args:
        frames: Length of every sequence, shape ``(B,)``, integer.
        batch_size: Sequences per batch (the last batch of a window may be shorter).
        generator: CPU generator of the shuffles; advanced by the call.
        bucket: Batches per window sorted by length (0: no sorting, a plain random
            permutation cut into batches).
        min_steps: Fewest batches of the epoch (1: one pass, every sequence exactly once).

    Returns:
        ``epoch_steps(B, batch_size, min_steps)`` index tensors, int64.

    Raises:
        ValueError: ``frames`` not of shape ``(B,)`` with ``B >= 1``, ``batch_size < 1``,
            ``bucket < 0`` or ``min_steps < 1``.

    Example:
        >>> frames = torch.tensor([1, 9, 2, 8])
        >>> batches = epoch_batches(frames, 2, torch.Generator().manual_seed(0), bucket=2)
        >>> sorted(sorted(frames[b].tolist()) for b in batches)
        [[1, 2], [8, 9]]
        >>> len(epoch_batches(frames, 2, torch.Generator().manual_seed(0), min_steps=5))
        6
    """
    if not isinstance(frames, Tensor) or frames.dim() != 1 or len(frames) == 0:
        raise ValueError("frames must be a tensor of shape (B,) with B >= 1")
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 0:
        raise ValueError(f"bucket must be an int >= 0, got {bucket!r}")
    steps = epoch_steps(len(frames), batch_size, min_steps)
    batches: list[Tensor] = []
    while len(batches) < steps:
        batches.extend(_one_pass(frames, batch_size, generator, bucket))
    return batches


def _one_pass(
    frames: Tensor, batch_size: int, generator: torch.Generator, bucket: int
) -> list[Tensor]:
    """The batches of one pass over the sequences of a split, each exactly once."""
    order = torch.randperm(len(frames), generator=generator)
    if bucket == 0:
        return list(order.split(batch_size))
    batches = []
    for window in order.split(batch_size * bucket):
        by_length = window[torch.argsort(frames[window], stable=True)]
        batches.extend(by_length.split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
